"""`gpulab profile --try num_workers=2 --steps 30 -- python train.py`: measure advice before taking it.

The script runs twice for its first K steps (after the warm-up): once as it is, once with the
change forced on every DataLoader it builds (no edit of the script). Each run stops after K steps.
The answer is the two step-time distributions side by side, and their ratio: a fix that does not
pay on this machine shows up as one.
"""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from gpulab.errors import UserError
from gpulab.io import atomic_write_json, check_writable
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.analyze.phases import percentile, step_seconds
from gpulab.monitor.events import diagnosed_lane
from gpulab.monitor.runner import default_out_dir, run_job, split_python_command

TRYABLE = {"num_workers": int, "prefetch_factor": int, "pin_memory": bool, "persistent_workers": bool}


def parse_overrides(items: list[str]) -> dict:
    """["num_workers=2", "pin_memory=true"] -> {"num_workers": 2, "pin_memory": True}."""
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in TRYABLE:
            raise UserError(f"--try {item}: use KEY=VALUE with KEY one of {', '.join(TRYABLE)}, e.g. --try num_workers=2")
        kind = TRYABLE[key]
        if kind is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise UserError(f"--try {item}: {key} is true or false")
            overrides[key] = text.lower() in ("true", "1")
        else:
            if not text.isdigit() or (key == "prefetch_factor" and int(text) < 1):
                raise UserError(f"--try {item}: {key} is a whole number{' of 1 or more' if key == 'prefetch_factor' else ''}")
            overrides[key] = int(text)
    return overrides


def try_command(command: list[str], out: Path | None, cfg: ProfileConfig, items: list[str], steps: int) -> int:
    overrides = parse_overrides(items)
    if steps < 3:
        raise UserError(f"--steps {steps}: measure at least 3 steps (e.g. --steps 30) to see a spread")
    interpreter, options, target = split_python_command(command)
    out = out or default_out_dir(target)
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    argv = [interpreter, *options, *target]
    limit = cfg.warmup_steps + steps
    runs = {}
    for label, changes in (("as it is", {}), ("with " + " ".join(items), overrides)):
        job = run_job(argv, replace(cfg, stop_after_steps=limit, dataloader_overrides=changes), out)
        times = _step_times(job.lanes, job.pid, cfg.warmup_steps)
        if len(times) < 3:
            raise UserError(f"--try: the run {label} ended after {len(times)} measured steps (exit code "
                            f"{job.exit_code}): it needs {steps} steps after {cfg.warmup_steps} of warm-up")
        runs[label] = _distribution(times)
    result = {"overrides": overrides, "steps": steps, "warmup_steps": cfg.warmup_steps, "runs": runs}
    before, after = runs.values()
    result["speedup"] = round(before["median_s"] / after["median_s"], 3)
    result["verdict"] = verdict(before, after)
    atomic_write_json(out / "try.json", result)
    _print(result, out)
    return 0


def verdict(before: dict, after: dict) -> str:
    """"faster" or "slower" only when the change moves the median out of the other run's p10-p90
    range; a difference inside the step-to-step spread is no measured effect."""
    if after["median_s"] < before["p10_s"]:
        return "faster"
    if after["median_s"] > before["p90_s"]:
        return "slower"
    return "within the spread of the steps: no clear change"


def _step_times(lanes, main_pid: int, warmup: int) -> list[float]:
    """Step times after the warm-up of the process the profile would diagnose."""
    lane = diagnosed_lane(lanes, main_pid)
    return [step_seconds(s) for s in lane.steps[warmup:]] if lane else []


def _distribution(times: list[float]) -> dict:
    return {"steps": len(times), "median_s": statistics.median(times), "p10_s": percentile(times, 0.1),
            "p90_s": percentile(times, 0.9)}


def _print(result: dict, out: Path) -> None:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    console.print(f"\n[bold]gpulab profile --try[/]: step time over {result['steps']} steps after "
                  f"{result['warmup_steps']} of warm-up (median \\[p10 .. p90])")
    for label, d in result["runs"].items():
        console.print(f"  {label:<32} {d['median_s'] * 1e3:8.2f} ms  \\[{d['p10_s'] * 1e3:.2f} .. {d['p90_s'] * 1e3:.2f}]")
    console.print(f"  the change makes each step [bold]{result['speedup']:.2f}x[/] ({result['verdict']}); "
                  f"wrote {out}/try.json")
