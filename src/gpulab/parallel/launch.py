"""`gpulab launch`: run `gpulab train` under torchrun without spelling out torchrun's options.

    gpulab launch -n 2 -- --epochs 5                       2 processes on this machine
    gpulab launch -n 4 --nnodes 2 --node-rank 0 --master 10.0.0.1:29500 -- --epochs 5
                                                           (and --node-rank 1 on the other machine)

It is torch.distributed.run (torchrun) itself, called in this process with the options below;
gpulab adds the checks torchrun answers with a stack trace (the rendezvous port already taken, a
node that never arrives) and a one-line summary of which rank failed and how.
"""

from __future__ import annotations

import math
import os
import signal
import socket

from gpulab.errors import UserError

DEFAULT_PORT = 29500
LAUNCHED_BY_GPULAB = "GPULAB_LAUNCH"
"""Set to 1 in the environment of the ranks `gpulab launch` starts: their messages then name the
command the user typed (gpulab launch, its one-line summary), not torchrun under it."""


def launcher() -> str:
    """The command that started this rank, as its messages name it."""
    return "gpulab launch" if os.environ.get(LAUNCHED_BY_GPULAB) == "1" else "torchrun"


def exit_summary() -> str:
    """Where the user reads how a failed rank exited: torchrun's summary, or the one line that
    gpulab launch prints in its place."""
    return "gpulab launch's last line" if launcher() == "gpulab launch" else "torchrun's summary"


def parse_master(master: str) -> tuple[str, int]:
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise UserError(f"--master {master}: give the first machine's address and a free port, e.g. 10.0.0.1:{DEFAULT_PORT}")
    return host, int(port)


def check_port_free(port: int) -> None:
    """Node 0 hosts the rendezvous on this port; torchrun's own error for a taken port is a traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            raise UserError(
                f"port {port} is already in use on this machine (another job's rendezvous?): "
                f"choose another with --master ADDR:PORT"
            ) from None


def torchrun_args(nproc: int, nnodes: int, node_rank: int, master: str | None, startup_timeout_s: float,
                  train_args: list[str]) -> list[str]:
    if nproc < 1:
        raise UserError(f"-n {nproc}: launch at least 1 process per machine")
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise UserError(f"--node-rank {node_rank} with --nnodes {nnodes}: node ranks go from 0 to {nnodes - 1}")
    if not (math.isfinite(startup_timeout_s) and startup_timeout_s >= 1):  # torchrun takes whole seconds
        raise UserError(f"--startup-timeout {startup_timeout_s:g}: give the seconds to wait for every machine, "
                        "1 or more (default 600)")
    args = ["--nproc-per-node", str(nproc)]
    if nnodes == 1 and master is None:
        args.append("--standalone")  # one machine: torchrun picks a free port itself
    else:
        if master is None:
            raise UserError(f"--nnodes {nnodes}: give every machine the first one's address with --master ADDR:PORT")
        host, port = parse_master(master)
        if node_rank == 0:
            check_port_free(port)
        args += [
            "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr", host, "--master-port", str(port),
            "--rdzv-conf", f"timeout={int(startup_timeout_s)}",
        ]
    return [*args, "-m", "gpulab", "train", *train_args]


def launch(nproc: int, nnodes: int = 1, node_rank: int = 0, master: str | None = None,
           startup_timeout_s: float = 600, train_args: list[str] | None = None) -> int:
    args = torchrun_args(nproc, nnodes, node_rank, master, startup_timeout_s, list(train_args or []))
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Each rank gets an equal share of this machine's cores (torchrun would give each one thread).
    from gpulab.host import usable_cores

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, usable_cores() // nproc)))
    os.environ[LAUNCHED_BY_GPULAB] = "1"  # torchrun passes this process's environment on to every rank
    try:
        run(get_args_parser().parse_args(args))
    except ChildFailedError as e:
        print(f"gpulab launch: {failure_summary(e)}", flush=True)
        return exit_code(e)
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: torchrun stopped the ranks (they said where)
        print(f"gpulab launch: stopped by {signal.Signals(e.sigval).name}", flush=True)
        return 128 + e.sigval
    except DistError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if "clients joined" in first or "Timed out" in first:
            raise UserError(
                f"not every machine joined within {startup_timeout_s:g} s ({first}): start `gpulab launch` with the "
                f"same --nnodes on every machine, node ranks 0..{nnodes - 1}, and --master pointing at node 0"
            ) from None
        raise UserError(f"torchrun could not start: {first}") from None
    finally:
        os.environ.pop(LAUNCHED_BY_GPULAB, None)  # a job this process starts later is not launch's
    return 0


def exit_code(error) -> int:
    """2 when the ranks that failed of their own refused bad input (gpulab train's exit code for
    it, the line that says why printed once), as one process of gpulab train would - the others
    stopped by torchrun's SIGTERM once the first failed, some while on their own way out; else 1."""
    codes = {failure.exitcode for failure in error.failures.values()}
    return 2 if 2 in codes and codes <= {2, -signal.SIGTERM} else 1


def failure_summary(error) -> str:
    """One line from torchrun's ChildFailedError: the first rank that failed, how, and how many."""
    rank, first = error.get_first_failure()
    how = (f"was killed by {signal.Signals(-first.exitcode).name}" if first.exitcode < 0
           else f"exited with code {first.exitcode}")
    message = first.message.get("message", "") if isinstance(first.message, dict) else ""
    line = f"rank {rank} {how}" + (f" ({message})" if message else "")
    if len(error.failures) > 1:
        own = any(f.exitcode != -signal.SIGTERM for r, f in error.failures.items() if r != rank)
        line += (f"; {len(error.failures)} ranks stopped in all "
                 + ("(the others' lines above say why)" if own else "(torchrun stopped the others)"))
    return line
