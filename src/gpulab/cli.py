"""`gpulab devices | train | profile | bench`: the command line, a thin layer over the modules.

User errors (`UserError`) become one line on stderr and exit code 2; Ctrl-C exits with 130.
"""

from __future__ import annotations

import argparse
import json
import sys

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
    from rich.table import Table

    console = Console()
    cuda = f"CUDA {report['torch_cuda_build']} build" if report["torch_cuda_build"] else "CPU-only build"
    driver = report["driver"]
    head = f"torch {report['torch']} ({cuda})"
    if "driver" in driver:
        head += f"   driver {driver['driver']}" + (f", CUDA {driver['cuda_driver']}" if "cuda_driver" in driver else "")
    console.print(head)
    if report["gpus"]:
        table = Table("#", "name", "memory used / total", "util", "temp", "power")
        for g in report["gpus"]:
            table.add_row(
                str(g["index"]),
                g["name"],
                f"{g['memory_used_mib']:,.0f} / {g['memory_total_mib']:,.0f} MiB",
                _fmt(g["utilization_pct"], "%"),
                _fmt(g["temperature_c"], " C"),
                _fmt(g["power_w"], " W", limit=g.get("power_limit_w")),
            )
        console.print(table)
    else:
        console.print("no GPU found: training runs on the CPU (use --devices cpu*K to exercise multi-device code)")
    c = report["cpu"]
    table = Table("cpu", "cores", "torch threads", "memory free / total")
    table.add_row(
        c["model"],
        f"{c['logical_cores']}/{c['physical_cores']}",
        str(c["torch_threads"]),
        f"{c['memory_available_gib']:.1f} / {c['memory_total_gib']:.1f} GiB",
    )
    console.print(table)
    for w in report["warnings"]:
        console.print(f"[bold yellow]warning:[/] {w}")
    return 0


def _fmt(value, unit: str, limit=None) -> str:
    if value is None:
        return "n/a"
    text = f"{value:.0f}{unit}"
    return f"{text} / {limit:.0f}{unit}" if limit else text


# ----------------------------------------------------------------------------- train


def add_train_parser(sub) -> None:
    # No choices= here: importing the model/recipe tables would import torch just to build the
    # parser (2 s before `gpulab profile` can start a script). TrainConfig validates every value.
    p = sub.add_parser("train", help="train a model, data-parallel over the chosen devices")
    # Every default is None so that only options the user typed override TrainConfig's defaults.
    p.add_argument("--model", default=None, help="lenet (default) or resnet18")
    p.add_argument("--data", default=None, help="dataset (fashion-mnist)")
    p.add_argument("--data-dir", default=None, help="folder with the IDX files (default: $GPULAB_DATA, cache, Debian's path)")
    p.add_argument("--devices", default=None, help="auto (default: every GPU, else CPU) | cpu | cpu*K | cuda:0,cuda:1 | gpu:N")
    p.add_argument("--epochs", type=int, default=None, help="number of epochs (default 10)")
    p.add_argument(
        "--batch-size", type=int, default=None,
        help="GLOBAL minibatch size (default 256): with k devices each device gets about batch-size/k",
    )
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--recipe", default=None, help="modern (default) or textbook (SGD, lr 0.2)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--allreduce", default=None, help="gradient allreduce: auto (default), naive, ring or nccl")
    p.add_argument("--sync-bn", action="store_const", const=True, default=None, help="BatchNorm statistics over the whole minibatch")
    p.add_argument(
        "--scale-batch", action="store_const", const=True, default=None,
        help="multiply the batch and the learning rate by the number of devices (with one epoch of warm-up)",
    )
    p.add_argument("--eval-batch-size", type=int, default=None)
    p.add_argument("--channels-last", default=None, help="auto (default: on for CPU), on or off")
    p.add_argument("--precision", default=None, help="auto (default: bf16 autocast on CPUs with native bf16), fp32 or bf16")
    p.add_argument("--out", default=None, help="run directory (default runs/<timestamp>-<model>)")
    p.add_argument("--profile", action="store_const", const=True, default=None, help="sample utilisation; write a timeline")
    p.add_argument("--resume", metavar="RUN_DIR", default=None, help="continue a run from its last checkpoint")
    p.add_argument(
        "--check-parity", action="store_true",
        help="run a few steps on 1 device and on the chosen devices; report the max parameter difference",
    )
    p.set_defaults(func=run_train)


_TRAIN_FIELDS = (
    "model", "data", "data_dir", "devices", "epochs", "batch_size", "lr", "recipe", "seed", "allreduce",
    "sync_bn", "scale_batch", "eval_batch_size", "channels_last", "precision", "out", "profile",
)


def run_train(args) -> int:
    from gpulab.train import TrainConfig, train

    given = {f: getattr(args, f) for f in _TRAIN_FIELDS if getattr(args, f) is not None}
    if args.resume:
        if given:
            raise UserError(
                f"--resume continues a run with its saved config; drop {', '.join('--' + f.replace('_', '-') for f in given)}"
            )
        train(resume=args.resume)
        return 0
    cfg = TrainConfig(**given)
    if args.check_parity:
        from gpulab.parallel.parity import check_parity_cli

        return check_parity_cli(cfg)
    train(cfg)
    return 0


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpulab", description="Put every device to work in training, and see where the time goes.")
    parser.add_argument("--version", action="version", version=f"gpulab {__import__('gpulab').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add_devices_parser(sub)
    add_train_parser(sub)
    from gpulab.bench.cli import add_bench_parser
    from gpulab.monitor.cli import add_profile_parser

    add_profile_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        print(f"gpulab: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gpulab: interrupted", file=sys.stderr)
        return 130
