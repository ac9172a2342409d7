"""The training loop, read top to bottom:

    train      a new run, or one resumed from its directory: set up (start), then fit
    fit        epoch after epoch: run_epoch, then end_epoch; any rank's failure stops all
    run_epoch  the epoch's steps (Trainer.step: gpulab.train.step), the running metrics on the
               device and one collective read per epoch (plus, every CHECK_EVERY steps, the
               non-finite flag)
    end_epoch  evaluation, the divergence rule, checkpoint and metrics

What it runs is built by `build` (gpulab.train.build). The same loop runs in one process over
k devices and as every rank of a torchrun job; the `World` decides who prints and writes
(rank 0) and stops every rank together when one fails.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress

from gpulab import models
from gpulab.compiler import CompileClock
from gpulab.config import TrainConfig
from gpulab.devices import synchronize
from gpulab.errors import Terminated, UserError, sigterm_raises
from gpulab.host import CoreWatch, seconds_since_start
from gpulab.io import check_writable as check_folder_writable, remedy
from gpulab.memory.peak import peak_memory, reset_peaks
from gpulab.monitor import profile
from gpulab.parallel import World
from gpulab.parallel.failures import PeerLost
from gpulab.parallel.world import SharedError, from_environment
from gpulab.train.build import Run, build, check_options_apply
from gpulab.train.display import banner, contention_line, epoch_line, progress_bar, result_line
from gpulab.train.recipe import lr_at
from gpulab.train.resume import (extension_line, interrupted_line, restore, resume_command, resume_hint, saved_config,
                                 start_over_command)
from gpulab.train.rundir import PROFILE, RunDir, Trust, check_writable, claims, default_run_dir
from gpulab.train.step import FiniteWatch, Meter

CHECK_EVERY = 50
"""Steps between reads of the running non-finite flag (FiniteWatch): a diverged run stops within
its epoch, without a host sync per step."""
DIVERGENCE_FACTOR = 100.0
"""An epoch whose training or test loss exceeds this many times the first epoch's training loss
has exploded (see `divergence`)."""


class NonFiniteLoss(RuntimeError):
    """The run diverged: a non-finite loss, or an epoch that exploded (`divergence`)."""


def train(
    cfg: TrainConfig | None = None,
    resume: str | None = None,
    console: Console | None = None,
    on_epoch_end: Callable[[dict], None] | None = None,
    train_data=None,
    test_data=None,
    model: torch.nn.Module | None = None,
    loss_fn=None,
    optimizer=None,
    data_dir: str | None = None,
    epochs: int | None = None,
    trust: Trust = Trust(),
) -> dict:
    """Train as configured, or continue the run in directory `resume` with its saved config
    (`data_dir`: where its data is now, when it moved; `epochs`: a new total, to train on after
    the saved run's end; each replaces the saved value; `trust`: what the caller vouches for in
    that directory - the model's import path, a sharded checkpoint torch's own reader reads).

    Under torchrun (WORLD_SIZE > 1) this is one rank of the job: only rank 0 prints and writes.
    `train_data`/`test_data` (a Dataset or DataLoader each) replace Fashion-MNIST; `model` (an
    nn.Module), `loss_fn(outputs, labels) -> mean loss` and `optimizer` (params -> Optimizer)
    replace the built-in ones (see build()); a resumed run needs the same objects again. `model`
    ends with the trained weights. Returns the final epoch's metrics row.
    """
    world = from_environment()
    own = {"model": model, "loss_fn": loss_fn, "optimizer": optimizer}
    console = console or Console(highlight=False, soft_wrap=True)
    if not world.is_main:
        console = Console(quiet=True)
    # A lone process stops on SIGTERM (a scheduler, `timeout`) as on Ctrl-C: the epoch being
    # written is saved and the line says how to go on - unless a handler of the caller's is in
    # place; torchrun's ranks have their own protocol.
    alone = (sigterm_raises() if world.world_size == 1 and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
             else nullcontext())
    try:
        with alone, claims():  # the run directory is this run's until it ends, however it ends
            run, run_dir, history, start_epoch = start(world, cfg, resume, console, train_data, test_data, own,
                                                       data_dir, epochs, trust)
            row = history[-1] if start_epoch >= run.cfg.epochs else fit(run, run_dir, history, start_epoch, console,
                                                                         on_epoch_end)
            if model is not None:  # the caller's model ends trained, as plain PyTorch leaves it
                model.load_state_dict(run.strategy.state_dict()["model"])
            return row
    except (PeerLost, Terminated) as e:  # before training began (the loop reports its own)
        if world.world_size == 1:
            raise
        raise world.failure(e, "set-up", "Nothing was trained yet") from None
    finally:
        world.close()


def start(world: World, cfg, resume, console: Console, train_data, test_data, own: dict, data_dir=None,
          epochs=None, trust: Trust = Trust()) -> tuple[Run, RunDir, list[dict], int]:
    """Everything built and checked, then the run directory claimed (a new run) or read (a resumed
    one): (run, its directory, the epochs' rows so far, the first epoch to train)."""
    if resume:
        run_dir = RunDir(Path(resume), option="--resume", trust=trust)
        cfg, checkpoint, saved_epochs = saved_config(world, run_dir, data_dir, epochs)
    else:
        cfg = config_of_new_run(cfg or TrainConfig(), train_data, own["model"], data_dir)
        world.all_or_none(lambda: check_options_apply(cfg, world))
        run_dir = RunDir(world.share("run-dir", lambda: str(new_run_dir(cfg))), unique=not cfg.out)
    run = build(cfg, world, train_data, test_data, **own)  # validates devices and data before anything is written
    world.all_or_none(lambda: check_data_sizes(run))
    if resume:
        history, start_epoch = restore(run, run_dir, checkpoint, config_changed=data_dir is not None or epochs is not None)
        if start_epoch >= cfg.epochs:
            console.print(escape(f"{run_dir.path} is complete: {start_epoch} of {cfg.epochs} epochs trained; to train "
                                 f"it further, give a new total: gpulab train --resume {run_dir.path} --epochs N"))
            return run, run_dir, history, start_epoch
    else:
        # Only now, everything built, is the directory written: claimed (locked for the run's life,
        # a default name made unique), then config.json with what build() learnt (input shape).
        run_dir.path = Path(world.share("run-dir-claimed", lambda: run_dir.start(run.cfg.to_dict())))
        history, start_epoch = [], 0
    console.print(escape(banner(run, run_dir)))
    if resume and epochs is not None and epochs != saved_epochs and run.schedule_lr:  # (only rank 0 knows; only it prints)
        console.print(escape(extension_line(run, start_epoch)))
    return run, run_dir, history, start_epoch


def fit(run: Run, run_dir: RunDir, history: list[dict], start_epoch: int, console: Console,
        on_epoch_end: Callable[[dict], None] | None) -> dict:
    """Epoch after epoch from `start_epoch`: train, evaluate, checkpoint, print. A failure on any
    rank stops every rank, each with one line that says where and how to go on."""
    cfg, world = run.cfg, run.world
    if world.is_main and any(d.type == "cuda" for d in run.devices):
        run_dir.curves.prepare()  # while a GPU trains the host's cores are free: matplotlib's import now
    # --profile: the same machinery as `gpulab profile`; report, timeline and trace go to <run>/profile.
    profiling = profile(out=run_dir.path / PROFILE, console=console, real_folder=True) if cfg.profile and world.is_main else nullcontext()
    with profiling, progress_bar(console, show=world.is_main) as progress, writes_finished(run_dir):
        try:
            for epoch in range(start_epoch, cfg.epochs):
                try:
                    row = {"epoch": epoch + 1, **run_epoch(run, epoch, progress)}
                    end_epoch(run, epoch, row, run_dir, history)
                except NonFiniteLoss as e:
                    run_dir.writes.wait()  # the last good epoch's files, complete
                    raise diverged(e, run_dir, history) from None
                console.print(escape(epoch_line(row, cfg.epochs, run.strategy)))
                warning = contention_line(row, torch.get_num_threads())
                if warning:
                    console.print(escape(warning))
                if on_epoch_end:
                    on_epoch_end(row)
        except (KeyboardInterrupt, PeerLost, Terminated) as e:
            if isinstance(e, KeyboardInterrupt) or (isinstance(e, Terminated) and world.world_size == 1):
                # Ctrl-C, or SIGTERM to a lone process: an epoch being written is saved (its failure:
                # not what stopped the run), and the line says how to go on
                run_dir.writes.wait()
                console.print(escape(interrupted_line(run_dir, run.saved_epoch, world)))
                raise
            # another rank failed: say which, where, and how to go on
            hint = resume_hint(run_dir, run.saved_epoch, run.unconfirmed_epoch, world)
            raise world.failure(e, f"{run.position}", hint) from None
        except BaseException as e:
            world.report_failure(e)  # so the surviving ranks can name this rank and its reason
            raise
    console.print(escape(result_line(history, run)))
    return history[-1]


def run_epoch(run: Run, epoch: int, progress: Progress | None = None) -> dict:
    """One pass over the training set, step after step. Reads the device once, at the end (with
    every rank's totals), and every CHECK_EVERY steps the running non-finite flag (FiniteWatch:
    no per-step sync, and on a GPU no wait), so that a diverged run stops within the epoch."""
    cfg, loader = run.cfg, run.train_loader
    loader.set_epoch(epoch)
    meter = Meter(run.devices[0])
    watch = FiniteWatch(meter, run.trainer.sum_over_processes)
    run.timer.reset()
    reset_peaks(run.devices)
    task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=len(loader)) if progress else None
    synchronize(run.devices)
    cores = CoreWatch().start()
    row_extra = {}
    with CompileClock() as compiling:
        t0 = time.perf_counter()
        batches = iter(loader)
        for step in range(len(loader)):
            run.position = f"epoch {epoch + 1}, step {step + 1}/{len(loader)}"
            with run.timer.phase("data"):
                X, y = next(batches)
            if run.schedule_lr:
                run.trainer.set_lr(lr_at(epoch * len(loader) + step, cfg.epochs * len(loader), run.peak_lr,
                                         cfg.recipe_spec, run.warmup_steps))
            run.trainer.step(X, y, meter)
            if run.first_step_s is None:  # what the user waited for training to begin (one sync, once)
                synchronize(run.devices)
                run.first_step_s = seconds_since_start()
                row_extra = {"first_step_s": run.first_step_s}
            if progress:
                progress.advance(task)
            if (step + 1) % CHECK_EVERY == 0 and step + 1 < len(loader):  # the last step: read() reads it all
                seen = watch.poll(step + 1)
                if seen:  # every rank reads the same sum at the same step: all stop together
                    raise NonFiniteLoss(f"epoch {epoch + 1}: the training loss became {seen[0]} by step "
                                        f"{seen[1]}/{len(loader)}")
        stats = run.trainer.read(meter)  # also waits for the device: the epoch's time is complete
        synchronize(run.devices)
        # torch.compile's compiles (the first epoch's, a recompile) are reported apart from the epoch
        compile_seconds = compiling.take()
        seconds = time.perf_counter() - t0 - compile_seconds
    core_wait = cores.stop()
    if progress:
        progress.remove_task(task)
    if not math.isfinite(stats["loss"]):  # every rank sees the same sum: all stop together
        raise NonFiniteLoss(f"epoch {epoch + 1}: the training loss became {stats['loss']}")
    return {**epoch_row(run, stats, seconds, compile_seconds, core_wait), **row_extra}


def end_epoch(run: Run, epoch: int, row: dict, run_dir: RunDir, history: list[dict]) -> None:
    """Evaluate the epoch trained, then checkpoint it and write the metrics (appends `row` to
    `history`). An epoch that diverged (`divergence`) is not kept: the last good checkpoint stays."""
    run.position = f"end of epoch {epoch + 1} (evaluation and checkpoint)"
    row.update(evaluate(run))
    row["wall_s"] = seconds_since_start()  # since this process started: the time to this accuracy
    why = divergence(row, history)  # the same numbers on every rank: all stop together
    if why:
        raise NonFiniteLoss(f"epoch {epoch + 1}: {why}")
    row["lr_peak"] = run.peak_lr
    row["replicas"] = run.strategy.num_replicas
    history.append(row)
    state = checkpoint_state(run, run_dir, epoch + 1)  # collective: every rank takes part
    if run.world.is_main:
        write_epoch(run, run_dir, state, history)
    else:
        run.unconfirmed_epoch = epoch + 1
    # The others wait here for rank 0's writes (within --timeout), so a failure meanwhile is
    # reported at the epoch's end, not as step 1 of the next.
    run.world.barrier()
    if not run.world.is_main:
        run.saved_epoch, run.unconfirmed_epoch = epoch + 1, None


def write_epoch(run: Run, run_dir: RunDir, state: dict, history: list[dict]) -> None:
    """The epoch's checkpoint, then its metrics (rank 0). One process writes them while its next
    epoch trains, from a copy of the state (that epoch changes the tensors); torchrun's rank 0
    waits for them, so that every rank learns at the epoch's end whether they held; the last
    epoch's are waited for, as the run's result. The epoch before's writes finish first: their
    failure is raised here, naming that epoch."""
    raise_if(run_dir.writes.wait())
    epoch, last = history[-1]["epoch"], history[-1]["epoch"] == run.cfg.epochs
    if "shards" in state:  # every rank has written its shard already (collective)
        save_epoch(run_dir, state, history, run.world, last)
        run_dir.remove_shards_but(state["shards"])  # committed: the folders checkpoint.pt no longer names go
        run.saved_epoch = epoch
        return
    saved, rows = detached(state), [dict(r) for r in history]

    def write() -> None:
        save_epoch(run_dir, saved, rows, run.world, last)
        run.saved_epoch = epoch

    run_dir.writes.start(write)
    if last or run.world.world_size > 1:
        raise_if(run_dir.writes.wait())


def detached(state):
    """A copy of a state dict, its tensors copied to the CPU: what later steps cannot change."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {key: detached(value) for key, value in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(detached(value) for value in state)
    return state


def raise_if(failure: BaseException | None) -> None:
    if failure is not None:
        raise failure


@contextmanager
def writes_finished(run_dir: RunDir):
    """However the epochs end, no write of the run is left under way (its failure, if the run
    failed otherwise, is not the one to report)."""
    try:
        yield
    finally:
        run_dir.writes.wait()


# ----------------------------------------------------------------------------- the parts


def evaluate(run: Run) -> dict:
    t0 = time.perf_counter()
    result = run.trainer.evaluate(run.test_loader, run.loss_fn)
    accuracy = result["accuracy"] if run.loss_fn.classifies else None
    return {"test_loss": result["loss"], "test_acc": accuracy, "eval_seconds": time.perf_counter() - t0}


def divergence(row: dict, history: list[dict]) -> str | None:
    """Why this epoch diverged (so it must not be kept as good), or None.

    The rule: an epoch is good when its training loss and its test loss are both finite and
    neither exceeds DIVERGENCE_FACTOR (100) x its reference. The first epoch's mean loss lies
    between the untrained model's and what it learnt, and a healthy run stays below it
    (overfitting raises the test loss a few times, not a hundred), so 100x means the run exploded.
    The training loss's reference is the first epoch's training loss. The test loss's is the larger
    of the first epoch's two losses - a test set may sit far from the training set (a fine-tuned
    regressor's noisier targets: 400x its training loss from the start) - and in the first epoch,
    its training loss where the two are the same measure (class scores, with accuracy), else none.
    A reference <= 0 (a loss of the user's that can be negative) leaves only the finiteness rule."""
    first = history[0] if history else row
    classes = row.get("train_acc") is not None
    references = {
        "train_loss": first["train_loss"],
        "test_loss": max(first["train_loss"], first["test_loss"]) if history else (
            first["train_loss"] if classes else math.nan),
    }
    for key, name in (("train_loss", "training loss"), ("test_loss", "test loss")):
        value, reference = row[key], references[key]
        if not math.isfinite(value):
            return f"the {name} became {value}"
        if math.isfinite(reference) and reference > 0 and value > DIVERGENCE_FACTOR * reference:
            of = "training loss" if key == "train_loss" or not history else "losses"
            return f"the {name} became {value:.4g}, over {DIVERGENCE_FACTOR:g}x the first epoch's {of} ({reference:.4g})"
    return None


def diverged(error: NonFiniteLoss, run_dir: RunDir, history: list[dict]) -> SharedError:
    """The one line a diverged run stops with: what diverged, and what is kept."""
    # A checkpoint exists only once an epoch has finished; if the first one diverged
    # there is nothing to keep, and saying "epoch 0" would promise a file that isn't there.
    if history:
        kept = f"last good checkpoint (epoch {history[-1]['epoch']}) kept in {run_dir.path}: lower --lr"
    else:
        kept = (f"no checkpoint saved in {run_dir.path} (no epoch finished without diverging): start over there "
                f"with a lower --lr (gpulab train --out {run_dir.path} ...)")
    return SharedError(f"{error}; stopped, {kept}", printed_by=0)


def epoch_row(run: Run, stats: dict, seconds: float, compile_seconds: float, core_wait) -> dict:
    """The training half of an epoch's metrics row."""
    phases = {name: [round(s, 4) for s in per_device] for name, per_device in run.timer.summary().items()}
    return {
        "peak_memory": epoch_peak_memory(run),
        "train_loss": stats["loss"],
        "train_acc": stats["accuracy"] if run.loss_fn.classifies else None,
        "train_seconds": seconds,
        "compile_seconds": compile_seconds,
        "samples_per_s": stats["count"] / seconds,
        "phases_s": phases,
        "allreduce_share": [s / seconds for s in phases.get("allreduce", [0.0])],
        # the share of the epoch this process's busy threads waited for a core; more of them than cores?
        "core_wait_share": core_wait.share if core_wait else None,
        "cores_contended": core_wait.contended if core_wait else None,
        "threads_to_try": core_wait.threads_to_try(torch.get_num_threads()) if core_wait else None,
    }


def epoch_peak_memory(run: Run) -> dict[str, int]:
    """This epoch's peak memory per device ("cuda:0", or "cpu": the process's peak resident
    memory), and under torchrun per rank ("rank 1 cuda:1"): one gather per epoch."""
    peaks = peak_memory(run.devices)
    if run.world.world_size == 1:
        return peaks
    every = run.world.gather(peaks)
    if every is None:  # not the main rank: it keeps its own
        return {f"rank {run.world.rank} {device}": n for device, n in peaks.items()}
    return {f"rank {rank} {device}": n for rank, per_rank in enumerate(every) for device, n in per_rank.items()}


def checkpoint_state(run: Run, run_dir: RunDir, epoch: int) -> dict:
    """What checkpoint.pt holds of the strategy: its whole state (rank 0 writes it), or for a
    sharded run the folder every rank has just written its shard into."""
    if not run.strategy.sharded_checkpoint:
        return run.strategy.state_dict()
    folder = run_dir.shards_folder(epoch)
    try:
        run.strategy.save_shards(folder)
    except OSError as e:
        raise UserError(f"could not write epoch {epoch}'s shard to {folder} ({e.strerror or e}); the checkpoint "
                        f"before it is intact: {remedy(e)}, then {resume_command(run_dir, run.world)}") from None
    return {"shards": folder.name}


def save_epoch(run_dir: RunDir, state: dict, history: list[dict], world: World, last: bool) -> None:
    """The checkpoint, then the metrics. A write that fails (a full disk, a folder gone) is one
    line that says what is intact: the file being replaced is, by atomic_write_bytes."""
    epoch = history[-1]["epoch"]
    try:
        run_dir.save_checkpoint({"strategy": state, "history": history, "epoch": epoch})
    except OSError as e:
        if len(history) > 1:
            kept = (f"the checkpoint of epoch {history[-2]['epoch']} is intact: {remedy(e)}, then "
                    f"{resume_command(run_dir, world)}")
        else:
            kept = (f"no checkpoint was saved yet: {remedy(e)}, then start over with "
                    f"{start_over_command(run_dir, world)}")
        raise UserError(f"could not write epoch {epoch}'s checkpoint to {run_dir.path} ({e.strerror or e}); {kept}") from None
    try:
        run_dir.write_metrics(history, last)
    except OSError as e:
        raise UserError(f"epoch {epoch}'s checkpoint is saved in {run_dir.path} but its metrics could not be written "
                        f"({e.strerror or e}): {remedy(e)}, then {resume_command(run_dir, world)}") from None


def new_run_dir(cfg: TrainConfig) -> Path:
    """The main process picks the directory (a timestamp by default) and checks it is usable."""
    # A factory spec (package.module:factory) names the folder by its factory: no ':' in paths.
    path = Path(cfg.out) if cfg.out else default_run_dir(cfg.model.rpartition(":")[2])
    if cfg.out:
        check_writable(path)  # usable, not the user's other files, not a run with a checkpoint or in use
    else:
        check_folder_writable(path)  # the name itself is made unique when the run claims it
    return path


def check_data_sizes(run: Run) -> None:
    """Nothing to train or test on stops here, before the directory is written: not after an
    "epoch" of 0 samples saved as a result."""
    if len(run.train_loader) == 0:
        raise UserError(
            f"no training batches: the training data is empty or smaller than one batch of {run.batch_size} "
            "(the short last batch is dropped): use more data or a smaller --batch-size"
        )
    if len(run.test_loader) == 0:
        raise UserError("the test set is empty: pass test data with at least one sample")


def config_of_new_run(cfg: TrainConfig, train_data, model, data_dir: str | None) -> TrainConfig:
    """config.json must say what the run is: not Fashion-MNIST for the caller's own data, nor
    LeNet (nor name the folder after it) for the caller's own model."""
    if train_data is not None:
        cfg = dataclasses.replace(cfg, data="custom")
    if model is not None:
        cfg = dataclasses.replace(cfg, model=models.OBJECT)
    if data_dir is not None:
        cfg = dataclasses.replace(cfg, data_dir=data_dir)
    return cfg
