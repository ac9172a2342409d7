"""`gpulab bench <name>... [--devices SPEC] [--quick] [--out DIR [--force]]`: run benchmarks, print
tables, write DIR/<name>.json and DIR/<name>.png for each (never over files gpulab did not write
there, unless --force)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpulab import bench
from gpulab.errors import UserError, sigterm_raises

BUSY_PCT = 25.0
"""Warn when other processes use more than this share of the CPU before a run."""


def add_bench_parser(sub) -> None:
    listing = "\n".join(f"  {name:<15} {what}" for name, what in bench.BENCHMARKS.items())
    p = sub.add_parser(
        "bench",
        help="measure the GPU lessons: matmul, transfers, allreduce, scaling, input pipeline, ...",
        description=f"benchmarks (each writes DIR/<name>.json and DIR/<name>.png):\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("names", nargs="+", metavar="NAME", help=f"all, or one or more of: {', '.join(bench.BENCHMARKS)}")
    p.add_argument(
        "--devices", default=None,
        help="devices to measure: cpu | cpu*K | cuda:0,cuda:1 | gpu:N (default: the CPU and every GPU; "
        "multi-device benchmarks use every GPU, or virtual CPU replicas cpu*K without GPUs)",
    )
    size = p.add_mutually_exclusive_group()
    # Both write args.preset; the default lives on the parser so that neither option's own
    # default can overwrite the other's.
    size.add_argument(
        "--quick", dest="preset", action="store_const", const="quick",
        help="small sizes for CI and smoke tests (all nine took 2 minutes on a quiet 2-core CPU, the training demo most of it)",
    )
    size.add_argument(
        "--preset", choices=bench.PRESETS,
        help="full (default: for reports), quick (= --quick) or tiny (seconds; checks the code paths only)",
    )
    p.set_defaults(preset="full")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of the benchmarks that run whole contenders in turn, round after round (training; "
                        "default: the preset's, 3 for full): 1 for a first look where time is short")
    p.add_argument("--out", default="bench-out", help="output folder (default: bench-out); files there that gpulab "
                   "did not write are never replaced")
    p.add_argument("--force", action="store_true", help="replace files in the --out folder that gpulab did not write")
    p.set_defaults(func=run_bench)


def output_names(names: list[str]) -> list[str]:
    """What the benchmarks `names` write: <name>.json and <name>.png each."""
    return [f"{name}.{ext}" for name in names for ext in ("json", "png")]


def run_bench(args) -> int:
    with sigterm_raises():  # its temporary folders and measuring processes go with it
        return _run_bench(args)


def _run_bench(args) -> int:
    from gpulab.bench.environment import contention_warning, environment
    from gpulab.bench.runner import Context, run_benchmark
    from gpulab.devices import resolve
    from gpulab.io import OutputFolder, check_writable, given_path

    names = bench.expand(args.names)
    if args.rounds is not None:
        if args.rounds < 1:
            raise UserError(f"--rounds {args.rounds}: must be >= 1")
        if not any(bench.repeats_rounds(bench.load(name)) for name in names):
            raise UserError(f"--rounds: {', '.join(names)} run no rounds (training does); leave --rounds out")
    devices = None if args.devices in (None, "auto") else resolve(args.devices)
    out_dir = given_path(args.out)
    outputs = OutputFolder.out(out_dir, args.force)
    check_writable(out_dir)
    outputs.check(output_names(names))  # before any benchmark runs
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 150)
    ctx = Context(preset=args.preset, rounds=args.rounds, devices=devices, console=console)
    command = shlex.join(
        ["gpulab", "bench", *args.names]
        + (["--devices", args.devices] if args.devices else [])
        + (["--quick"] if args.preset == "quick" else ["--preset", args.preset] if args.preset != "full" else [])
        + (["--rounds", str(args.rounds)] if args.rounds is not None else [])
        + ["--out", args.out]
        + (["--force"] if args.force else [])
    )

    env = environment()
    gpus = ", ".join(g["name"] for g in env["gpus"]) or "no GPU"
    console.print(escape(
        f"gpulab bench {' '.join(names)} ({args.preset}) on {env['cpu']['model']} "
        f"({env['cpu']['logical_cores']} cores, {env['torch_threads']} torch threads) + {gpus}; "
        f"torch {env['torch']}; {env['date']} -> {out_dir}"
    ))
    if env["cpu_busy_pct"] > BUSY_PCT:
        when = f"before the start (load average {env['load_avg_1m']})"
        console.print(escape("warning: " + contention_warning(env["cpu_busy_pct"], when)), style="bold yellow")
    started = time.perf_counter()
    results = [run_benchmark(name, ctx, outputs, command=command, env=env) for name in names]
    total = time.perf_counter() - started

    if len(results) > 1:
        table = Table(
            "benchmark", "status", "time", "others' CPU", "headline", title=f"gpulab bench: {total:.0f} s", title_justify="left"
        )
        for r in results:
            status = "[green]ok[/]" if r.status == "ok" else "[bold red]FAILED[/]"
            table.add_row(
                r.name, status, f"{r.wall_s:.0f} s", f"{r.other_load_pct:.0f}%", escape(r.summary.get("headline", r.error or ""))
            )
        console.rule()
        console.print(table)
    failed = [r.name for r in results if r.status != "ok"]
    if failed:
        console.print(f"[bold red]{len(failed)} benchmark(s) failed their equality checks:[/] {', '.join(failed)}")
        return 1
    return 0

