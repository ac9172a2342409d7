"""What a run prints: the banner, one line per epoch, the result (rich renders them; rank 0 prints)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gpulab import models
from gpulab.devices import format_devices
from gpulab.memory.categories import size
from gpulab.parallel.sharded import Sharded
from gpulab.parallel.strategy import Strategy
from gpulab.train.build import Run
from gpulab.train.rundir import RunDir


def placement(run: Run) -> str:
    """"[cpu*2]", "[cuda:0, cuda:1]", or "4 ranks x [cuda:0]" (this rank's device) under torchrun."""
    where = format_devices(run.devices)
    return f"{run.world.world_size} ranks x {where}" if run.world.world_size > 1 else where


def banner(run: Run, run_dir: RunDir) -> str:
    cfg, strategy = run.cfg, run.strategy
    per = "rank" if run.world.world_size > 1 else "device"
    model = "your model" if cfg.model == models.OBJECT else cfg.model
    schedule = f"recipe {cfg.recipe}, lr {run.peak_lr:g}" if run.schedule_lr else "your optimizer and its lr"
    no_batchnorm = cfg.sync_bn and not models.has_batchnorm(strategy.replicas[0])
    return (
        f"training {model} on {placement(run)}: {cfg.epochs} epochs, batch {run.batch_size} "
        f"(~{run.batch_size // strategy.num_replicas} per {per}), {schedule}, "
        f"{precision(run)}{COMPILED[run.compile]}, {strategy.description} -> {run_dir.path}"
        + ("\n--sync-bn has no effect here: this model has no BatchNorm layers" if no_batchnorm else "")
    )


COMPILED = {"off": "", "record": ", recorded as a CUDA graph", "on": ", torch.compile",
            "graphs": ", torch.compile + CUDA graphs"}


def precision(run: Run) -> str:
    if isinstance(run.strategy, Sharded):
        return "fp32" if run.strategy.param_dtype is None else "bf16 (FSDP's mixed precision)"
    return "fp32" if run.trainer.autocast is None else "bf16 autocast"


def epoch_line(row: dict, epochs: int, strategy: Strategy) -> str:
    if row["train_acc"] is None:  # not a classifier: the losses say it all
        metrics = f"loss {row['train_loss']:.4f}  test loss {row['test_loss']:.4f}"
    else:
        metrics = f"loss {row['train_loss']:.4f}  train acc {row['train_acc']:.3f}  test acc {row['test_acc']:.3f}"
    line = (f"epoch {row['epoch']:>2}/{epochs}  {metrics}  {row['train_seconds']:.1f} s  "
            f"{row['samples_per_s']:,.0f} samples/s")
    if row.get("compile_seconds", 0) >= 0.05:  # torch.compile's time, apart from the epoch's
        line += f"  (+ {row['compile_seconds']:.1f} s compiling)"
    if strategy.num_replicas > 1 and not isinstance(strategy, Sharded):  # FSDP reduce-scatters inside backward
        shares = "/".join(f"{s:.0%}" for s in row["allreduce_share"])
        line += f"  waiting for gradients {shares}"
    return line


def contention_line(row: dict, threads: int) -> str | None:
    """One line when the epoch's busy threads waited for a core a large share of it, with more of
    them than cores (gpulab.host.CoreWait): another process on the same cores, or more threads
    than cores (torch's OpenMP threads meet at the end of every op, so one thread without a core
    holds the others). `threads`: torch's; the row's `threads_to_try`: gpulab.host.CoreWait's rule."""
    if not row.get("cores_contended"):
        return None
    fix = f"run with fewer threads (OMP_NUM_THREADS={row['threads_to_try']} gpulab train ...) or " if threads > 1 else "run "
    return (f"warning: epoch {row['epoch']}'s threads waited for a core {row['core_wait_share']:.0%} of the epoch "
            f"(another process on these cores, or more threads than cores): {fix}on cores no other process uses")


def result_line(history: list[dict], run: Run) -> str:
    final = history[-1]
    sec_per_epoch = sum(r["train_seconds"] for r in history) / len(history)
    result = f"test acc: {final['test_acc']:.3f}" if final["test_acc"] is not None else f"test loss: {final['test_loss']:.4g}"
    line = f"{result}, {sec_per_epoch:.1f} sec/epoch on {placement(run)}"
    peaks = peak_memory_text(history)
    return f"{line}, {peaks}" if peaks else line


def peak_memory_text(history: list[dict]) -> str | None:
    """'peak memory 1.2 GiB on cuda:0', 'peak resident memory 812 MiB on cpu', or per rank; None
    for a history written before gpulab recorded it (a resumed older run)."""
    peaks: dict[str, int] = {}
    for row in history:
        for where, nbytes in row.get("peak_memory", {}).items():
            peaks[where] = max(peaks.get(where, 0), nbytes)
    if not peaks:
        return None
    cpu = all(where.split()[-1] == "cpu" for where in peaks)
    listing = ", ".join(f"{size(n)} on {where}" for where, n in peaks.items())
    return f"peak resident memory {listing} (the whole process)" if cpu else f"peak memory {listing}"


def progress_bar(console: Console, show: bool) -> Progress:
    """The current epoch's steps, erased when the epoch's line is printed."""
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=console, transient=True, disable=not show)
