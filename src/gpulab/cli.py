"""`gpulab devices | train | launch | profile | bench | export`: the command line, a thin layer over the modules.

User errors (`UserError`) become one line on stderr and exit code 2; a rank that stops because
another rank failed exits with 1; Ctrl-C exits with 130. Under torchrun a line is printed once
(by the rank it concerns, prefixed "[rank r]") and also written where torchrun's failure
summary looks for it (TORCHELASTIC_ERROR_FILE).
"""

from __future__ import annotations

import argparse
import atexit
import errno
import json
import os
import sys
import threading
import time

from gpulab.bytecode import use_own_cache_where_needed
from gpulab.errors import Terminated, UserError


class _Parser(argparse.ArgumentParser):
    """argparse, but usage errors are one line (plus the hint to --help), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"gpulab: error: {message} (see {self.prog} --help)\n")


# ----------------------------------------------------------------------------- train


def add_train_parser(sub) -> None:
    from gpulab.options import add_config_options, train_fields

    p = sub.add_parser("train", help="train a model, data-parallel over the chosen devices")
    add_config_options(p, train_fields())
    p.add_argument(
        "--resume", metavar="RUN_DIR", default=None,
        help="continue a run from its last checkpoint, with its saved options; only --data-dir (where its data is now) "
        "and --epochs (a new total, to train a finished run further) may be given, and --model, the same import path "
        "as the run's own model, to say you trust the code it names",
    )
    add_trust_option(p)
    p.add_argument(
        "--check-parity", action="store_true",
        help="run a few steps as configured and the same steps in plain PyTorch on one model; "
        "report the max parameter difference (also under torchrun)",
    )
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from gpulab.models import check_named
    from gpulab.options import given_options, train_fields
    from gpulab.parallel.world import SharedError
    from gpulab.train import TrainConfig, train
    from gpulab.train.rundir import Trust

    given = given_options(args, train_fields())
    check_named(given.get("model"))
    if args.resume == "":  # a shell variable never set: not "start a new run"
        raise SharedError("--resume '': an empty path; give the run directory to continue")
    if args.resume:
        # where the data is now; a new total; the run's own model, trusted
        others = [f for f in given if f not in ("data_dir", "epochs", "model")]
        if others:  # every rank of a torchrun job reads the same options: rank 0 says it
            raise SharedError(
                f"--resume continues a run with its saved config; drop {', '.join('--' + f.replace('_', '-') for f in others)}"
            )
        if args.check_parity:
            raise SharedError("--check-parity checks a run's settings before it trains, not a run to continue: drop "
                              "--resume (gpulab train --check-parity with the run's options)")
        train(resume=args.resume, data_dir=given.get("data_dir"), epochs=given.get("epochs"),
              trust=Trust(model=given.get("model"), checkpoint=args.trust_checkpoint))
        return 0
    if args.trust_checkpoint:
        raise SharedError("--trust-checkpoint is for reading a run's checkpoint: give it with --resume RUN_DIR")
    try:
        cfg = TrainConfig(**given)
    except UserError as e:  # every rank of a torchrun job reads the same options: rank 0 says it
        raise SharedError(str(e), printed_by=0) from None
    if args.check_parity:
        from gpulab.train.parity_check import check_parity

        unused = [f"--{name}" for name in ("out", "epochs", "profile") if name in given]
        if unused:  # it trains a few steps, writes nothing: these would be silently ignored
            raise SharedError(f"--check-parity checks a few steps against plain PyTorch and writes no run: drop "
                              f"{', '.join(unused)}")
        return check_parity(cfg)
    train(cfg)
    return 0


def add_trust_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trust-checkpoint", action="store_true",
        help="read a sharded checkpoint that gpulab's allow-list refuses with torch's own reader, which runs code the "
        "files name: only for a run you made or whose maker you trust (README: Trust)",
    )


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
    p.add_argument("--out", default=None, help="model file (default RUN_DIR/model.onnx); the numbers go to OUT.json; "
                   "files gpulab did not write are never replaced")
    p.add_argument("--force", action="store_true", help="replace OUT or OUT.json where gpulab did not write them")
    p.add_argument("--model", default=None, metavar="PACKAGE.MODULE:FACTORY",
                   help="the run's own model, when it names one by import path: the same path, to say you trust the "
                   "code it names (gpulab never imports a path read from a run directory on its own)")
    add_trust_option(p)
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    from gpulab.export import VerificationFailed, export
    from gpulab.train.rundir import Trust

    try:
        export(args.run_dir, args.out, args.format, force=args.force,
               trust=Trust(model=args.model, checkpoint=args.trust_checkpoint))
    except VerificationFailed as e:  # not bad input: the exported model disagrees with PyTorch
        print(f"gpulab: error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gpulab", description="Put every device to work in training, and see where the time goes.")
    parser.add_argument("--version", action="version", version=f"gpulab {__import__('gpulab').__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    from gpulab.hardware.cli import add_devices_parser

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


def run() -> None:
    """The `gpulab` command (the console script, `python -m gpulab`): main(), then leave."""
    leave(main())


def leave(code: int) -> None:
    """Exit with `code` as sys.exit would, less the interpreter's teardown: freeing torch's modules
    and objects one by one takes longer than many a command's own work, and nothing needs it
    (measured in docs/benchmarks.md). The exit handlers run first, as at any exit (a profile's
    recorder, torch's, multiprocessing's, logging's); every file gpulab writes is closed by then.
    While a thread Python would wait for is alive, the ordinary exit, which waits for it; and a
    failing rank under torchrun exits the ordinary way too: torchrun stops the other ranks as soon
    as one fails, and a rank that left at once could cut short the one whose turn it is to say why
    (an error every rank raises is printed by one; tests/parallel/test_torchrun.py lost that line)."""
    waited_for = any(not t.daemon for t in threading.enumerate() if t is not threading.main_thread())
    if waited_for or (code != 0 and os.environ.get("TORCHELASTIC_ERROR_FILE")):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # started with it closed (>&-): Python gives None
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (gpulab ... | head): nothing left to say
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    use_own_cache_where_needed()  # before torch is imported: read-only installs compile it every time
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # Under torchrun: an unexpected exception's traceback goes where torchrun's summary reads it.
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(_main)(argv)
    return _main(argv)


_OUTPUT_LOST = {errno.ENOSPC, errno.EPIPE, errno.EBADF, errno.EIO}


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UserError as e:
        rank = _rank()  # an error every rank raises together is printed by one (printed_by)
        return _fail(e, 2, printed_here=rank is None or getattr(e, "printed_by", rank) == rank)
    except OSError as e:
        if e.errno not in _OUTPUT_LOST:
            raise
        # what gpulab prints could not be written (stdout on a full disk, a closed pipe); results
        # that go to files are written by writing_results, which says so itself
        return _fail(UserError(f"could not print the results: {e.strerror}; send the output somewhere it "
                               "can be written"), 1, printed_here=True)
    except Exception as e:
        from gpulab.parallel.failures import JobFailed

        if not isinstance(e, JobFailed):
            raise
        return _fail(e, 1, printed_here=not e.quiet)
    except KeyboardInterrupt:
        print("gpulab: interrupted", file=sys.stderr)
        return 130
    except Terminated:
        return _fail(RuntimeError("stopped by SIGTERM"), 128 + 15, printed_here=True)


def _rank() -> int | None:
    """This process's rank in a torchrun job, or None in a plain process (or where torchrun's
    variables are not numbers: the error being printed says so)."""
    try:
        in_job = int(os.environ.get("WORLD_SIZE", "1") or 1) > 1 and "RANK" in os.environ
        return int(os.environ["RANK"]) if in_job else None
    except ValueError:
        return None


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
