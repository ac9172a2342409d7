"""`gpulab devices [--json]`: the GPUs (via NVML), the CPU and the torch build, and one verdict."""

from __future__ import annotations

import json

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def add_devices_parser(sub) -> None:
    p = sub.add_parser("devices", help="list devices: GPUs (via NVML), CPU, torch build")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_devices)


def run_devices(args) -> int:
    # Imported when the command runs, not when the parser is built: describe imports torch, which
    # the other commands' parent processes (`gpulab profile`'s) must not pay for.
    from gpulab.hardware.describe import describe

    report = describe()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    console = Console()

    def say(prefix: str, text: str) -> None:
        # soft_wrap: verdicts and warnings stay one line each, however narrow the terminal;
        # escape: a CUDA_VISIBLE_DEVICES value or an NVML message is text, not rich markup.
        console.print(prefix + escape(text), soft_wrap=True)

    say("", _devices_headline(report))
    if "nvml" in report["driver"]:
        say("[dim]GPU details unavailable:[/] ", report["driver"]["nvml"])
    if report["gpus"]:
        console.print(_gpu_table(report))
    console.print(_cpu_table(report["cpu"]))
    for w in report["warnings"]:
        say("[bold yellow]warning:[/] ", w)
    for note in report["notes"]:
        say("[bold]note:[/] ", note)
    verdict = report["verdict"]
    style = {"ok": "bold green", "warning": "bold yellow", "error": "bold red", "no_gpu": "bold"}[verdict["status"]]
    label = "" if verdict["status"] == "no_gpu" else f"[{style}]{verdict['status']}:[/] "
    say(label, verdict["message"])
    if verdict["fix"]:
        say("  [bold]fix:[/] ", verdict["fix"])
    return 0


def _devices_headline(report: dict) -> str:
    """'torch 2.11.0+cu130 (CUDA 13.0 build)   driver 580.159.04 (supports CUDA up to 13.0)'."""
    head = f"torch {report['torch']} ({report['torch_build']} build)"
    driver = report["driver"]
    if driver.get("driver"):
        supports = f" (supports CUDA up to {driver['cuda_driver']})" if "cuda_driver" in driver else ""
        head += f"   driver {driver['driver']}{supports}"
    return head


def _gpu_table(report: dict) -> Table:
    """One row per GPU in torch's order (cuda:0, cuda:1, …), then the GPUs hidden from torch."""
    gpu_build = report["torch_sees_gpus"] > 0 or report["torch_cuda_build"] is not None
    table = Table("cuda", "nvml", "name", "memory used / total", "util", "temp", "power")
    for g in report["gpus"]:
        if g["cuda_index"] is not None:
            where = f"cuda:{g['cuda_index']}"
        elif g["mig_enabled"]:
            where = "MIG"
        else:
            where = "hidden" if gpu_build else "-"  # with a CPU-only build no GPU is hidden, none is usable
        table.add_row(
            where,
            "-" if g["nvml_index"] is None else str(g["nvml_index"]),
            g["name"] or "(unreadable)",
            _fmt_memory(g["memory_used_mib"], g["memory_total_mib"]),
            _fmt(g["utilization_pct"], "%"),
            _fmt(g["temperature_c"], " C"),
            _fmt(g["power_w"], " W", limit=g.get("power_limit_w")),
        )
        for m in g["mig_instances"]:
            table.add_row(
                "-" if m["cuda_index"] is None else f"cuda:{m['cuda_index']}", "", f"  {m['name'] or 'MIG instance'}",
                _fmt_memory(None, m["memory_total_mib"]), "", "", "",
            )
    return table


def _cpu_table(c: dict) -> Table:
    table = Table("cpu", "cores", "torch threads", "memory free / total")
    table.add_row(
        c["model"],
        f"{c['logical_cores']}/{c['physical_cores']}",
        str(c["torch_threads"]),
        f"{c['memory_available_gib']:.1f} / {c['memory_total_gib']:.1f} GiB",
    )
    return table


def _fmt_memory(used, total) -> str:
    if total is None:
        return "n/a"
    return ("n/a" if used is None else f"{used:,.0f}") + f" / {total:,.0f} MiB"


def _fmt(value, unit: str, limit=None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.0f}{unit}"
    return f"{text} / {limit:.0f}{unit}" if limit else text
