"""`gpulab devices | train | launch | profile | bench | export`: the command line, a thin layer over the modules.

User errors (`UserError`) become one line on stderr and exit code 2; a rank that stops because
another rank failed exits with 1; Ctrl-C exits with 130. Under torchrun a line is printed once
(by the rank it concerns, prefixed "[rank r]") and also written where torchrun's failure
summary looks for it (TORCHELASTIC_ERROR_FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gpulab.errors import UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (plus the hint to --help), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"gpulab: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------- devices


def add_devices_parser(sub) -> None:
    p = sub.add_parser("devices", help="list devices: GPUs (via NVML), CPU, torch build")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.set_defaults(func=run_devices)


def run_devices(args) -> int:
    from gpulab import devices

    report = devices.describe()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.markup import escape

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


def _gpu_table(report: dict):
    """One row per GPU in torch's order (cuda:0, cuda:1, …), then the GPUs hidden from torch."""
    from rich.table import Table

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


def _cpu_table(c: dict):
    from rich.table import Table

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


# ----------------------------------------------------------------------------- train


def add_train_parser(sub) -> None:
    from gpulab.options import add_config_options, train_fields

    p = sub.add_parser("train", help="train a model, data-parallel over the chosen devices")
    add_config_options(p, train_fields())
    p.add_argument(
        "--resume", metavar="RUN_DIR", default=None,
        help="continue a run from its last checkpoint, with its saved options; only --data-dir (where its data is now) "
        "and --epochs (a new total, to train a finished run further) may be given",
    )
    p.add_argument(
        "--check-parity", action="store_true",
        help="run a few steps as configured and the same steps in plain PyTorch on one model; "
        "report the max parameter difference (also under torchrun)",
    )
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from gpulab.options import given_options, train_fields
    from gpulab.parallel.world import SharedError
    from gpulab.train import TrainConfig, train

    given = given_options(args, train_fields())
    if args.resume:
        others = [f for f in given if f not in ("data_dir", "epochs")]  # where the data is now; a new total
        if others:  # every rank of a torchrun job reads the same options: rank 0 says it
            raise SharedError(
                f"--resume continues a run with its saved config; drop {', '.join('--' + f.replace('_', '-') for f in others)}"
            )
        train(resume=args.resume, data_dir=given.get("data_dir"), epochs=given.get("epochs"))
        return 0
    try:
        cfg = TrainConfig(**given)
    except UserError as e:  # every rank of a torchrun job reads the same options: rank 0 says it
        raise SharedError(str(e), printed_by=0) from None
    if args.check_parity:
        from gpulab.train.parity_check import check_parity

        return check_parity(cfg)
    train(cfg)
    return 0


# ----------------------------------------------------------------------------- launch


def add_launch_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="run gpulab train under torchrun: one process per device, on one machine or several",
        description="Runs `torchrun ... -m gpulab train TRAIN_ARGS`. Example: gpulab launch -n 2 -- --epochs 5",
    )
    p.add_argument("-n", "--nproc-per-node", type=int, required=True, help="processes on this machine (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this machine's number, 0..nnodes-1 (default 0)")
    p.add_argument("--master", default=None, help="ADDR:PORT of node 0's rendezvous (needed with --nnodes > 1)")
    p.add_argument(
        "--startup-timeout", type=float, default=600,
        help="seconds to wait for every machine to join (default 600)",
    )
    p.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then the options of gpulab train")
    p.set_defaults(func=run_launch)


def run_launch(args) -> int:
    from gpulab.parallel.launch import launch

    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return launch(args.nproc_per_node, args.nnodes, args.node_rank, args.master, args.startup_timeout, train_args)


# ----------------------------------------------------------------------------- export


def add_export_parser(sub) -> None:
    p = sub.add_parser(
        "export", help="export a trained run's model (ONNX) and verify it with onnxruntime",
        description="Exports RUN_DIR's model (checkpoint.pt, config.json) to ONNX with a dynamic batch "
        "dimension, checks onnxruntime against PyTorch on the run's test set, then writes OUT and OUT.json "
        "(exit 1 and nothing written when they disagree). Needs: pip install 'gpulab[onnx]'",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a gpulab train run directory")
    p.add_argument("--format", default="onnx", choices=["onnx"], help="onnx (default; the only one)")
    p.add_argument("--out", default=None, help="model file (default RUN_DIR/model.onnx); the numbers go to OUT.json")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from gpulab.export import VerificationFailed, export

    try:
        export(args.run_dir, args.out, args.format)
    except VerificationFailed as e:  # not bad input: the exported model disagrees with PyTorch
        print(f"gpulab: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpulab", description="Put every device to work in training, and see where the time goes.")
    parser.add_argument("--version", action="version", version=f"gpulab {__import__('gpulab').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_devices_parser(sub)
    add_train_parser(sub)
    add_launch_parser(sub)
    add_export_parser(sub)
    from gpulab.bench.cli import add_bench_parser
    from gpulab.monitor.cli import add_profile_parser
    from gpulab.plan.cli import add_plan_parser

    add_profile_parser(sub)
    add_bench_parser(sub)
    add_plan_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # Under torchrun: an unexpected exception's traceback goes where torchrun's summary reads it.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        rank = _rank()  # an error every rank raises together is printed by one (printed_by)
        return _fail(e, 2, printed_here=rank is None or getattr(e, "printed_by", rank) == rank)
    except Exception as e:
        from gpulab.parallel.world import JobFailed

        if not isinstance(e, JobFailed):
            raise
        return _fail(e, 1, printed_here=not e.quiet)
    except KeyboardInterrupt:
        print("gpulab: interrupted", file=sys.stderr)
        return 130
    except BaseException as e:
        from gpulab.parallel.world import Terminated

        if not isinstance(e, Terminated):
            raise
        return _fail(RuntimeError("stopped by SIGTERM"), 128 + 15, printed_here=True)


def _rank() -> int | None:
    """This process's rank in a torchrun job, or None in a plain process."""
    in_job = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "RANK" in os.environ
    return int(os.environ["RANK"]) if in_job else None


def _fail(error: Exception, code: int, printed_here: bool) -> int:
    rank = _rank()
    message = f"[rank {rank}] {error}" if rank is not None else str(error)
    if printed_here:
        print(f"gpulab: error: {message}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun's failure summary shows this line instead of "To enable traceback see ..."
        record = {"message": {"message": message, "extraInfo": {"timestamp": str(int(time.time()))}}}
        with open(error_file, "w") as f:
            json.dump(record, f)
    return code
