"""The outputs of a session: report.json, timeline.png, trace.json, and the short terminal report."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from gpulab.monitor import timeline, trace
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.diagnose import PHASE_NAMES, diagnose
from gpulab.monitor.recorder import Recording
from gpulab.io import atomic_write_bytes, atomic_write_json

OUTPUTS = ("report.json", "timeline.png", "trace.json")
ENVIRONMENT_KEYS = ("python", "torch", "torch_cuda_build", "cpu_count", "torch_threads")


def build_report(rec: Recording, samples: list[dict], gpus: list[dict], sampler: dict, cfg: ProfileConfig,
                 exit_code: int | None) -> dict:
    """diagnose()'s keys first (steps, step_time_s, phases, devices, findings), then the evidence behind them."""
    report = diagnose(rec, samples, gpus, cfg.warmup_steps)
    end = rec.end or {}
    report.update({
        "command": rec.start.get("command"),
        "exit_code": exit_code,
        "complete": rec.end is not None and exit_code == 0,
        "error": end.get("error"),
        "syncs": sorted(rec.sites, key=lambda s: (s["seconds"], s["count"]), reverse=True),
        "data_loaders": [_fields(r) for r in rec.loaders],
        "kernel_window": _fields(rec.kernels) if rec.kernels else None,
        "hot_lines": rec.hot,
        "hot_line_interval_s": rec.hot_interval_s,
        "cuda": end.get("cuda"),
        "environment": {k: rec.start.get(k) for k in ENVIRONMENT_KEYS},
        "sampler": sampler,
        "config": cfg.to_dict(),
    })
    return report


def _fields(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "type"}


def write_outputs(out: Path, report: dict, rec: Recording, samples: list[dict], gpus: list[dict], title: str) -> None:
    """Write the three outputs atomically (a reader never sees half a file)."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "report.json", report)
    atomic_write_bytes(out / "timeline.png", timeline.render(rec, samples, gpus, report, title))
    events = trace.build(rec, samples, gpus, timeline.time_origin(rec, samples))
    atomic_write_bytes(out / "trace.json", json.dumps(events, separators=(",", ":")).encode())


def print_report(report: dict, out: Path, console: Console | None = None) -> None:
    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    for line in terminal_lines(report, out):
        console.print(line)


def terminal_lines(report: dict, out: Path) -> list[str]:
    """The short human report: step time, where it goes, the findings with evidence, where and fix."""
    step = report["step_time_s"]
    lines = [""]
    head = f"[bold]gpulab profile[/]: {report['steps']} steps"
    if report["steps"]:
        head += (f" ({report['steady_steps']} measured), median step {step['median'] * 1e3:.1f} ms, "
                 f"p90 {step['p90'] * 1e3:.1f} ms")
    if report.get("exit_code"):
        head += f"  [yellow](script exited with {report['exit_code']}: partial report)[/]"
    lines.append(head)
    phases = "  ".join(f"{PHASE_NAMES[k]} {v:.0%}" for k, v in report["phases"].items())
    busy = report.get("device_busy")
    if busy:
        phases += f"   device busy {busy['share']:.0%} ({escape(busy['source'])})"
    lines.append(f"  step time: {phases}")
    for n, f in enumerate(report["findings"], 1):
        if f["cause"] == "none":
            lines.append(f"  [bold green]no bottleneck stands out[/]: {escape(f['evidence'])}")
            lines.append(f"     [dim]next:[/]  {escape(f['fix'])}")
            continue
        lines.append(f"  [bold]{n}. {f['cause']}[/] [red]{f['share']:.0%}[/] of step time")
        lines.append(f"     [dim]evidence:[/] {escape(f['evidence'])}")
        if f["where"]:
            lines.append(f"     [dim]where:[/]    {escape(f['where'])}")
        lines.append(f"     [dim]fix:[/]      {escape(f['fix'])}")
    syncs = [s for s in report.get("syncs", []) if s["kind"] == "sync"]
    if syncs and not any(f["cause"] == "host_sync" for f in report["findings"]):
        top = syncs[0]
        lines.append(f"  [dim]host syncs seen (cost under the threshold): {'/'.join(top['ops'])} at "
                     f"{escape(str(top['where']))}, {top['count']} calls[/]")
    lines.append(f"  wrote {escape(str(out))}/{{{', '.join(OUTPUTS)}}} (open trace.json in ui.perfetto.dev)")
    return lines
