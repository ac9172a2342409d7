"""Continuing a run from its checkpoint: its saved config, what may change (the data's place, a
new epoch total), what must not (the replica count under --scale-batch, the model), and what to
say when a run stops."""

from __future__ import annotations

from gpulab.config import TrainConfig
from gpulab.devices import names_several
from gpulab.errors import UserError
from gpulab.io import remedy
from gpulab.parallel import World
from gpulab.parallel.launch import launcher
from gpulab.parallel.world import SharedError
from gpulab.train.build import Run
from gpulab.train.recipe import lr_at
from gpulab.train.rundir import CHECKPOINT, RunDir, parse_config


def saved_config(world: World, run_dir: RunDir, data_dir: str | None, epochs: int | None) -> tuple[TrainConfig, dict | None, int | None]:
    """The saved run's config (with the data's new place and a new epoch total, when given), its
    checkpoint (rank 0's; None on the other ranks) and the epoch total it was saved with. Read
    before anything is built: a run with nothing to resume says so before loading data."""
    checkpoint, saved_epochs = None, None

    def read() -> dict:
        nonlocal checkpoint, saved_epochs
        config = run_dir.trusted_config()
        run_dir.claim_for_resume()  # this run's from here on: a second one is refused
        checkpoint = run_dir.load_checkpoint()
        if data_dir is not None:
            config["data_dir"] = data_dir  # the data moved (made absolute by TrainConfig)
        saved_epochs = config.get("epochs")
        if epochs is not None:
            config["epochs"] = new_total_epochs(epochs, checkpoint["epoch"], saved_epochs, run_dir)
        return parse_config(config, run_dir.label).to_dict()

    # Validated on rank 0 (a damaged config.json is said once); the others get the checked dict.
    cfg = TrainConfig.from_dict(world.share("config", read))
    if world.world_size > 1 and names_several(cfg.devices):  # its replicas live in one process
        raise SharedError(f"{run_dir.label}: this run trained on --devices {cfg.devices}, several devices in one "
                          f"process, and goes on the same way: gpulab train --resume {run_dir.path}")
    return cfg, checkpoint, saved_epochs


def restore(run: Run, run_dir: RunDir, checkpoint: dict | None, config_changed: bool) -> tuple[list[dict], int]:
    """Rank 0's checkpoint into every rank's run: (the epochs' metrics so far, the epoch to go on from).
    Rank 0 rewrites config.json when the data's place or the epoch total changed (later resumes
    find them), and the metrics when a full disk left them behind the checkpoint."""
    world = run.world
    checkpoint = world.broadcast(checkpoint)  # only rank 0's machine needs to hold the run directory
    history = checkpoint["history"]
    check_resumable(run.cfg, history, run.strategy.num_replicas)
    load_weights(run, checkpoint, run_dir)
    if world.is_main:
        try:
            if config_changed:
                run_dir.write_config(run.cfg.to_dict())
            if history and run_dir.metrics_epochs() != [r["epoch"] for r in history]:
                run_dir.write_metrics(history)
        except OSError as e:
            raise UserError(f"--resume {run_dir.path}: cannot write there ({e.strerror or e}); {remedy(e)}, then "
                            "resume again") from None
    run.saved_epoch = checkpoint["epoch"]
    return history, checkpoint["epoch"]


def extension_line(run: Run, start_epoch: int) -> str:
    """What --resume with a new --epochs total does to the learning rate."""
    cfg, steps = run.cfg, len(run.train_loader)
    lr = lr_at(start_epoch * steps, cfg.epochs * steps, run.peak_lr, cfg.recipe_spec, run.warmup_steps)
    return (f"extending from epoch {start_epoch} to {cfg.epochs}: the learning rate follows a "
            f"{cfg.epochs}-epoch {cfg.recipe_spec.schedule} schedule from here (lr {lr:.3g} now)")


def load_weights(run: Run, checkpoint: dict, run_dir: RunDir) -> None:
    """The checkpoint's state into the run, or one line when it was saved by another model."""
    state = checkpoint["strategy"]
    if ("shards" in state) != run.strategy.sharded_checkpoint:
        saved = "sharded (--shard fsdp)" if "shards" in state else "whole (replicated)"
        raise SharedError(f"--resume {run_dir.path}: {CHECKPOINT} holds a {saved} checkpoint, which this run's "
                          "strategy cannot read: resume it as it was saved (its config.json says how)")
    try:
        if "shards" in state:
            run.strategy.load_shards(run_dir.path / state["shards"], trust=run_dir.trust.checkpoint)
        else:
            run.strategy.load_state_dict(state)
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        detail = detail if len(detail) <= 200 else detail[:200] + "..."
        raise SharedError(
            f"--resume {run_dir.path}: {CHECKPOINT} does not fit the model {run.cfg.model} ({detail}); it was "
            "saved by another model: resume a run of this model, or start a new run"
        ) from None


def new_total_epochs(epochs: int, done: int, saved: int | None, run_dir: RunDir) -> int:
    """--resume with --epochs: a total no smaller than what the run has trained."""
    if epochs < done:
        raise UserError(f"--epochs {epochs}: {run_dir.path} has already trained {done} epochs; "
                        f"give a total of {done} or more (it was {saved})")
    return epochs


def check_resumable(cfg: TrainConfig, history: list[dict], replicas: int) -> None:
    """Another number of replicas computes the same global batches, except with --scale-batch,
    where the batch, the learning rate and the warm-up follow the replica count."""
    before = history[-1].get("replicas", replicas) if history else replicas
    if cfg.scale_batch and before != replicas:
        raise SharedError(
            f"this run scales its batch and learning rate with the replica count (--scale-batch) and trained "
            f"with {before}: resume it with {before} replicas, not {replicas}"
        )


def interrupted_line(run_dir: RunDir, saved_epoch: int, world: World) -> str:
    if saved_epoch:
        return f"interrupted after epoch {saved_epoch}: continue with {resume_command(run_dir, world)}"
    # no checkpoint: nothing to resume, but the same --out starts over in place
    again = start_over_command(run_dir, world)
    return f"interrupted before the first checkpoint: start over with {again}" + (" (and the same options)" if world.world_size == 1 else "")


def resume_hint(run_dir: RunDir, saved_epoch: int, unconfirmed_epoch: int | None, world: World) -> str:
    """How to go on after another rank failed, as far as this rank knows: the last checkpoint it
    knows is written (`saved_epoch`, 0: none) and, while rank 0 was writing the next one when the
    job broke (`unconfirmed_epoch`), both possibilities."""
    resume, again = resume_command(run_dir, world), start_over_command(run_dir, world)
    if unconfirmed_epoch is not None and saved_epoch:
        return (f"Last checkpoint: epoch {saved_epoch}, or {unconfirmed_epoch} if rank 0 finished writing it, in "
                f"{run_dir.path}; continue with {resume}")
    if unconfirmed_epoch is not None:
        return (f"Rank 0 was writing the first checkpoint (epoch {unconfirmed_epoch}): if {run_dir.path / CHECKPOINT} "
                f"exists, continue with {resume}; if not, start over with {again}")
    if not saved_epoch:  # nothing to resume: the same --out starts the run over in place
        return f"No checkpoint yet in {run_dir.path}; start over with {again}"
    return f"Last checkpoint: epoch {saved_epoch}, in {run_dir.path}; continue with {resume}"


def resume_command(run_dir: RunDir, world: World) -> str:
    """The command that continues this run from its checkpoint, as the user started it."""
    if world.world_size == 1:
        return f"gpulab train --resume {run_dir.path}"
    if launcher() == "gpulab launch":
        return f"gpulab launch (the same options) -- --resume {run_dir.path}"
    return f"the same torchrun command with gpulab train --resume {run_dir.path}"


def start_over_command(run_dir: RunDir, world: World) -> str:
    """The command that starts this run over in place (no checkpoint: its --out is free again)."""
    return f"gpulab train --out {run_dir.path}" if world.world_size == 1 else f"the same {launcher()} command"
