"""`gpulab profile --try num_workers=2 --steps 30 -- python train.py`: measure advice before taking it.

The script runs twice for its first K steps (after the warm-up): once as it is, once with the
change forced on every DataLoader it builds (no edit of the script). Each run stops after K steps.
The answer is the two step-time distributions side by side, and their ratio: a fix that does not
pay on this machine shows up as one. A change that cannot act (prefetch_factor on a loader without
workers) is refused, not measured: its ratio would only be noise.
"""

from __future__ import annotations

import statistics
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from gpulab.errors import UserError
from gpulab.host import usable_cores
from gpulab.io import atomic_write_json, check_writable, writing_results
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.analyze.phases import percentile, step_seconds
from gpulab.monitor.events import diagnosed_lane
from gpulab.monitor.runner import default_out_dir, run_job, split_python_command

TRYABLE = {"num_workers": int, "prefetch_factor": int, "pin_memory": bool, "persistent_workers": bool}
WORKER_SETTINGS = ("prefetch_factor", "persistent_workers")  # DataLoader ignores them without workers
WORKERS_PER_CORE = 4  # beyond this, workers only compete for the cores (and each is a process)


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
    _check_workers(overrides)
    return overrides


def _check_workers(overrides: dict) -> None:
    """Refuse at once what cannot be measured: more workers than the machine can run (each is a
    process: 100000 of them fork until the machine gives out), or a worker setting with none."""
    workers = overrides.get("num_workers")
    cores = usable_cores()
    if workers is not None and workers > WORKERS_PER_CORE * cores:
        raise UserError(f"--try num_workers={workers}: this machine has {cores} usable cores, and more than "
                        f"{WORKERS_PER_CORE * cores} workers ({WORKERS_PER_CORE} per core) only compete for them: "
                        f"try num_workers={_workers_to_try()}")
    if workers == 0:
        for key in WORKER_SETTINGS:
            if key in overrides:
                raise UserError(f"--try {_item(key, overrides[key])} with num_workers=0: {key} only acts with "
                                f"num_workers > 0: try it with --try num_workers={_workers_to_try()}")


def _workers_to_try() -> int:
    """The workers worth a first try: one per usable core but the one the training process keeps."""
    return max(1, usable_cores() - 1)


def check_change_acts(overrides: dict, loaders: list[dict]) -> None:
    """After the run as it is: a worker setting (prefetch_factor, persistent_workers) on loaders that
    all have num_workers=0 changes nothing (DataLoader ignores it), so it is refused, not measured."""
    settings = [key for key in WORKER_SETTINGS if key in overrides]
    if not settings or "num_workers" in overrides or not loaders:
        return
    if all(loader["num_workers"] == 0 for loader in loaders):
        key = settings[0]
        where = loaders[0]["where"] or "the script"
        raise UserError(f"--try {_item(key, overrides[key])}: {key} only acts with num_workers > 0, and the "
                        f"DataLoader at {where} has num_workers=0: try both, --try num_workers={_workers_to_try()} "
                        f"--try {_item(key, overrides[key])}")


def _item(key: str, value) -> str:
    """A setting as --try takes it (true, not True)."""
    return f"{key}={str(value).lower()}"


def try_command(command: list[str], out: Path | None, cfg: ProfileConfig, items: list[str], steps: int) -> int:
    overrides = parse_overrides(items)
    if steps < 3:
        raise UserError(f"--steps {steps}: measure at least 3 steps (e.g. --steps 30) to see a spread")
    interpreter, options, target = split_python_command(command)
    out = out or default_out_dir(target)
    check_writable(out)
    argv = [interpreter, *options, *target]
    with _removed_if_refused(out):
        before, loaders = _measure(argv, cfg, {}, "as it is", steps, out)
        check_change_acts(overrides, loaders)
        label = "with " + " ".join(items)
        after, _ = _measure(argv, cfg, overrides, label, steps, out)
        result = {"overrides": overrides, "steps": steps, "warmup_steps": cfg.warmup_steps,
                  "runs": {"as it is": before, label: after}}
        result["speedup"] = round(before["median_s"] / after["median_s"], 3)
        result["verdict"] = verdict(before, after)
        with writing_results():
            atomic_write_json(out / "try.json", result)
    _print(result, out)
    return 0


def _measure(argv: list[str], cfg: ProfileConfig, changes: dict, label: str, steps: int,
             out: Path) -> tuple[dict, list[dict]]:
    """Run the first steps with `changes` forced on the DataLoaders: the step-time distribution,
    and the loaders the diagnosed process iterated."""
    limit = cfg.warmup_steps + steps
    job = run_job(argv, replace(cfg, stop_after_steps=limit, dataloader_overrides=changes), out)
    lane = diagnosed_lane(job.lanes, job.pid)
    times = [step_seconds(s) for s in lane.steps[cfg.warmup_steps:]] if lane else []
    if len(times) < 3:
        raise UserError(f"--try: the run {label} ended after {len(times)} measured steps (exit code "
                        f"{job.exit_code}): it needs {steps} steps after {cfg.warmup_steps} of warm-up")
    return _distribution(times), lane.loaders


@contextmanager
def _removed_if_refused(out: Path):
    """The output folder, created here; a trial refused part-way leaves no empty folder behind."""
    existed = out.exists()
    with writing_results():
        out.mkdir(parents=True, exist_ok=True)
    try:
        yield
    except BaseException:
        if not existed and not any(out.iterdir()):
            out.rmdir()
        raise


def verdict(before: dict, after: dict) -> str:
    """"faster" or "slower" only when the change moves the median out of the other run's p10-p90
    range; a difference inside the step-to-step spread is no measured effect."""
    if after["median_s"] < before["p10_s"]:
        return "faster"
    if after["median_s"] > before["p90_s"]:
        return "slower"
    return "within the spread of the steps: no clear change"


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
