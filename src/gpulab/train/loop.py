"""The training loop: build everything from a TrainConfig, then epoch after epoch, batch ->
strategy step (forward, backward, gradient exchange, update), with the running metrics on the
device and one collective read per epoch (plus, every CHECK_EVERY steps, the non-finite flag).

The same loop runs in one process over k devices (`DataParallel`) and as every rank of a
torchrun job (`Distributed`); the `World` decides who prints and writes (rank 0) and stops every
rank together when one fails.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from gpulab import data, models
from gpulab.devices import for_rank, format_devices, resolve
from gpulab.errors import UserError
from gpulab.host import fix_malloc_thresholds
from gpulab.io import check_writable as check_folder_writable
from gpulab.monitor import profile
from gpulab.monitor.phases import PhaseTimer
from gpulab.parallel import DataParallel, Meter, World
from gpulab.parallel.distributed import Distributed
from gpulab.parallel.meter import FiniteWatch, classifies
from gpulab.parallel.strategy import Strategy
from gpulab.parallel.world import PeerLost, SharedError, Terminated, choose_backend, from_environment
from gpulab.train.config import Recipe, TrainConfig
from gpulab.train.rundir import CHECKPOINT, RunDir, check_writable, claims, default_run_dir

CHECK_EVERY = 50
"""Steps between reads of the running non-finite flag (FiniteWatch): a diverged run stops within
its epoch, without a host sync per step."""
DIVERGENCE_FACTOR = 100.0
"""An epoch whose training or test loss exceeds this many times the first epoch's training loss
has exploded (see `divergence`)."""


class NonFiniteLoss(RuntimeError):
    """The run diverged: a non-finite loss, or an epoch that exploded (`divergence`)."""


def lr_at(step: int, total_steps: int, peak: float, recipe: Recipe, warmup_steps: int = 0) -> float:
    """Learning rate for `step` (0-based): linear warm-up, then constant or cosine decay."""
    if recipe.schedule == "onecycle":
        warmup_steps = max(warmup_steps, int(recipe.warmup_frac * total_steps))
    # Never warm up for more than half the run: a 1-epoch --scale-batch run must still decay.
    warmup_steps = min(warmup_steps, total_steps // 2)
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if recipe.schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(recipe: Recipe, lr: float):
    def factory(params):
        return torch.optim.SGD(
            params, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov, weight_decay=recipe.weight_decay
        )

    return factory


def synchronize(devices: list[torch.device]) -> None:
    for d in set(devices):
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def use_channels_last(cfg: TrainConfig, devices: list[torch.device]) -> bool:
    # On CPU, oneDNN's LeNet convolutions ran 1.5x and 2.2x faster on NHWC than NCHW in two runs
    # of benchmarks/train_speed.py; on CUDA with fp32 the gain is not established, so auto = off.
    if cfg.channels_last == "auto":
        return all(d.type == "cpu" for d in devices)
    return cfg.channels_last == "on"


def autocast_dtype(cfg: TrainConfig, devices: list[torch.device]) -> torch.dtype | None:
    """bf16 mixed precision, or None for plain fp32.

    auto: bf16 on CPUs whose oneDNN has native bf16 (AVX512-BF16/AMX): there LeNet trained 1.3x
    and 1.9x faster than fp32 channels_last in two runs of benchmarks/train_speed.py, at the
    same accuracy (10 epochs: 0.906 vs 0.908). On CUDA auto stays fp32 until a GPU measurement says otherwise.
    """
    if cfg.precision == "auto":
        on_cpu = all(d.type == "cpu" for d in devices)
        native_bf16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        return torch.bfloat16 if on_cpu and native_bf16 else None
    return torch.bfloat16 if cfg.precision == "bf16" else None


@dataclass
class Run:
    """Everything built from a config, ready to train."""

    cfg: TrainConfig
    world: World
    strategy: Strategy
    train_loader: data.DeviceLoader | data.HostLoader
    test_loader: data.DeviceLoader | data.HostLoader
    loss_fn: torch.nn.Module
    timer: PhaseTimer
    batch_size: int
    peak_lr: float
    warmup_steps: int
    schedule_lr: bool = True
    """The recipe's schedule sets the learning rate each step; a caller's own optimizer keeps its own."""
    position: str = "set-up"
    """Where the loop is ("epoch 2, step 37"), for the message when another rank fails."""

    @property
    def devices(self) -> list[torch.device]:
        return self.strategy.devices


# ----------------------------------------------------------------------------- building


def user_loader(source, batch_size: int, device: torch.device, train: bool, cfg: TrainConfig, world: World,
                channels_last: bool) -> data.HostLoader:
    """A user's own Dataset or DataLoader, batched by gpulab's rule and copied batch by batch to `device`.

    A Dataset is batched with GlobalBatches (the same batches as the built-in data would get).
    A DataLoader is used as it is in one process; under torchrun its dataset is re-batched with
    GlobalBatches (global batch = its batch_size), keeping its collate_fn, workers and pinning,
    so that every rank takes its own part of the same batches."""
    if not hasattr(source, "__len__"):
        raise UserError("train_data/test_data must have a length (a map-style Dataset or a DataLoader over one)")
    DataLoader = torch.utils.data.DataLoader
    if isinstance(source, DataLoader) and world.world_size == 1:
        return data.HostLoader(source, device, channels_last=channels_last)
    dataset, options = source, dict(pin_memory=device.type == "cuda")
    if isinstance(source, DataLoader):
        dataset = source.dataset
        options = dict(collate_fn=source.collate_fn, num_workers=source.num_workers, pin_memory=source.pin_memory)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise UserError("gpulab cannot split an IterableDataset between ranks or batches: pass a map-style Dataset")
    batches = data.GlobalBatches(
        len(dataset), batch_size, shuffle=train, seed=cfg.seed, rank=world.rank, world_size=world.world_size,
        drop_last=train,
    )
    return data.HostLoader(DataLoader(dataset, batch_sampler=batches, **options), device, channels_last=channels_last)


def make_loaders(cfg: TrainConfig, world: World, device: torch.device, batch_size: int, channels_last: bool,
                 train_data, test_data) -> tuple[data.DeviceLoader | data.HostLoader, data.DeviceLoader | data.HostLoader]:
    """Fashion-MNIST's splits go to the device whole (DeviceLoader); a user's data is batched on the host."""
    if isinstance(train_data, data.Split):
        args = dict(device=device, channels_last=channels_last, normalize=cfg.recipe_spec.normalize,
                    rank=world.rank, world_size=world.world_size)
        return (
            data.DeviceLoader(train_data, batch_size, shuffle=True, seed=cfg.seed, drop_last=True, **args),
            data.DeviceLoader(test_data, cfg.eval_batch_size, **args),
        )
    args = dict(device=device, cfg=cfg, world=world, channels_last=channels_last)
    return (
        user_loader(train_data, batch_size, train=True, **args),
        user_loader(test_data, cfg.eval_batch_size, train=False, **args),
    )


def sample_shape(source) -> tuple[int, ...] | None:
    """One input's shape (no batch dimension), from the first sample; None when it cannot be read
    without consuming the user's iterator."""
    if isinstance(source, data.Split):
        return tuple(source.images.shape[1:])
    dataset = source if isinstance(source, torch.utils.data.Dataset) else getattr(source, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or len(dataset) == 0:
        return None
    return tuple(torch.as_tensor(dataset[0][0]).shape)


def check_image_shape(source, model: str) -> None:
    """Fail with one line, not a shape error deep inside forward, when images do not fit a built-in
    model (the user's own model takes whatever its data holds)."""
    if model not in models.MODELS:
        return
    shape = sample_shape(source)
    if shape is None:
        return
    fits = len(shape) == 3 and shape[0] == 1 and (model != "lenet" or shape[1:] == (28, 28))
    if not fits:
        want = "1x28x28" if model == "lenet" else "1xHxW"
        raise UserError(f"train_data images have shape {'x'.join(map(str, shape))}; --model {model} takes {want} images")


def choose_devices(cfg: TrainConfig, world: World) -> list[torch.device]:
    """This process's devices: the --devices list in one process, one device per torchrun rank."""
    if world.world_size == 1:
        return resolve(cfg.devices)
    device = for_rank(cfg.devices, world.local_rank, world.local_world_size)
    choose_backend(cfg.backend, device)  # refuse nccl without GPUs before any rank connects
    return [device]


def global_batch_size(cfg: TrainConfig, replicas: int, train_data) -> int:
    """The batch of every step: --batch-size (x replicas with --scale-batch), or the caller's
    DataLoader's own batch_size when it passes one."""
    if isinstance(train_data, torch.utils.data.DataLoader) and train_data.batch_size is not None:
        return train_data.batch_size
    return cfg.batch_size * (replicas if cfg.scale_batch else 1)


def check_inputs(cfg: TrainConfig, world: World, batch_size: int, replicas: int, train_data, test_data) -> None:
    if isinstance(train_data, torch.utils.data.DataLoader) and train_data.batch_size is None and world.world_size > 1:
        raise UserError("under torchrun gpulab batches your data itself: pass a DataLoader with a batch_size, or the Dataset")
    if batch_size < replicas * cfg.accumulate:
        what = f"the {replicas} {'ranks' if world.world_size > 1 else 'devices'}"
        if cfg.accumulate > 1:
            what += f" x {cfg.accumulate} micro-batches (--accumulate)"
        raise UserError(f"--batch-size {batch_size} is smaller than {what}: use at least {replicas * cfg.accumulate}")
    if (train_data is None) != (test_data is None):
        raise UserError("pass both train_data and test_data, or neither (to use Fashion-MNIST)")
    if cfg.data == "custom" and train_data is None:
        raise UserError("this run trains on the caller's own data: pass train_data and test_data to train()")
    if train_data is not None:
        check_image_shape(train_data, cfg.model)
    if cfg.sync_bn and world.world_size > 1 and cfg.sync == "ddp":
        raise UserError("--sync-bn with --sync ddp is not supported (gpulab's sync BN runs with --sync gpulab): drop one")
    if cfg.recipe_spec.init == "textbook" and cfg.model != "lenet":
        raise UserError("--recipe textbook initialises the textbook's LeNet only: use --model lenet")


def make_strategy(cfg: TrainConfig, world: World, model: torch.nn.Module, devices: list[torch.device],
                  batch_size: int, lr: float, timer: PhaseTimer | None = None, optimizer=None) -> Strategy:
    optimizer = optimizer or make_optimizer(cfg.recipe_spec, lr)
    autocast = autocast_dtype(cfg, devices)
    if world.world_size > 1:
        return Distributed(
            model, world, devices[0], batch_size, optimizer, sync=cfg.sync, accumulate=cfg.accumulate,
            sync_bn=cfg.sync_bn, timer=timer, autocast=autocast,
        )
    return DataParallel(
        model, devices, optimizer=optimizer, allreduce=cfg.allreduce, sync_bn=cfg.sync_bn, timer=timer,
        autocast=autocast, accumulate=cfg.accumulate,
    )


def check_own_model(model: torch.nn.Module) -> None:
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        listing = ", ".join(sorted(str(d) for d in devices))
        raise UserError(f"the model's parameters are on several devices ({listing}): gpulab places one whole copy "
                        "per device itself - pass the model on one device (e.g. model.cpu())")


class CheckedLoss:
    """The loss function, checked on its first call: one-line errors instead of a broadcast error or
    a silently wrong gradient deep in the step. Also learns whether accuracy applies (class scores
    for integer labels), from shapes alone."""

    def __init__(self, loss_fn):
        self.loss_fn = loss_fn
        self.checked = False
        self.classifies = True

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.checked:
            return self.loss_fn(outputs, targets)
        if not isinstance(outputs, torch.Tensor):
            raise UserError(f"the model returned a {type(outputs).__name__}: gpulab trains models whose forward "
                            "returns one tensor (wrap the model to return the one the loss takes)")
        if outputs.shape[:1] != targets.shape[:1]:
            raise UserError(f"the model's outputs have batch size {outputs.shape[0] if outputs.dim() else 'none'} "
                            f"(shape {tuple(outputs.shape)}) but the labels have {targets.shape[0] if targets.dim() else 'none'}: "
                            "the first dimension of both must be the batch")
        if classifies(outputs, targets) and len(targets):
            # One host read, on the first step only: labels the class scores cannot index give
            # an IndexError deep in cross_entropy otherwise.
            low, high = torch.stack([targets.min(), targets.max()]).tolist()
            if low < 0 or high >= outputs.shape[1]:
                raise UserError(f"labels run from {low} to {high}, but the model gives {outputs.shape[1]} class scores "
                                f"(labels must be 0..{outputs.shape[1] - 1}; the built-in models have 10 classes): "
                                "relabel the data or use a model with more outputs")
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"the loss returned {shape}, not one number: gpulab needs the batch's mean loss "
                            "(e.g. reduction='mean', PyTorch's default)")
        self.classifies = classifies(outputs, targets)
        self.checked = True
        return loss


def build(cfg: TrainConfig, world: World | None = None, train_data=None, test_data=None,
          model: torch.nn.Module | None = None, loss_fn=None, optimizer=None) -> Run:
    """Everything a run needs. `train_data`/`test_data`: a Dataset or DataLoader of (input, label)
    to train on instead of Fashion-MNIST (the built-in data is loaded only when they are None).
    `model`: your own nn.Module instead of `cfg.model`; `loss_fn(outputs, labels)`: the batch's
    mean loss (default: cross-entropy); `optimizer`: a factory `params -> torch.optim.Optimizer`
    (default: the recipe's, with its learning-rate schedule; yours keeps its own learning rate)."""
    world = world or World()
    fix_malloc_thresholds()  # before the data is loaded: every step then reuses freed host memory
    if model is not None:
        check_own_model(model)
        cfg = dataclasses.replace(cfg, model=models.OBJECT)  # the run's config must not claim LeNet
    # Every check that needs no data runs before the first collective, on every rank together.
    devices = world.all_or_none(lambda: choose_devices(cfg, world))
    replicas = len(devices) * world.world_size
    recipe = cfg.recipe_spec
    batch_size = global_batch_size(cfg, replicas, train_data)
    peak_lr = (cfg.lr or recipe.lr) * (replicas if cfg.scale_batch else 1)
    world.all_or_none(lambda: check_inputs(cfg, world, batch_size, replicas, train_data, test_data))
    world.connect(devices[0], cfg.backend, cfg.timeout)
    if train_data is None:
        # One rank per machine finds (or downloads) the files first; the others then read them.
        train_data, test_data = world.local_main_first(lambda: data.load(cfg.data_dir, download=True))
    shape = sample_shape(train_data)
    if shape is not None:
        cfg = dataclasses.replace(cfg, input_shape=list(shape))  # for gpulab export
    # channels_last is a layout of images (C, H, W); other inputs keep theirs.
    channels_last = use_channels_last(cfg, devices) and (shape is None or len(shape) == 3)
    train_loader, test_loader = world.all_or_none(
        lambda: make_loaders(cfg, world, devices[0], batch_size, channels_last, train_data, test_data)
    )

    torch.manual_seed(cfg.seed)
    if model is None:
        model = models.build(cfg.model)
    if recipe.init == "textbook":
        model.init_textbook()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if any(d.type == "cuda" for d in devices):
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels

    timer = PhaseTimer(devices)
    strategy = make_strategy(cfg, world, model, devices, batch_size, peak_lr, timer, optimizer)
    # Linear scaling needs a warm-up: a k-times larger lr from step 0 diverges (Goyal et al. 2017).
    warmup_steps = len(train_loader) if cfg.scale_batch and replicas > 1 else 0
    return Run(
        cfg=cfg,
        world=world,
        strategy=strategy,
        train_loader=train_loader,
        test_loader=test_loader,
        loss_fn=CheckedLoss(loss_fn or torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing)),
        timer=timer,
        batch_size=batch_size,
        peak_lr=peak_lr,
        warmup_steps=warmup_steps,
        schedule_lr=optimizer is None,
    )


# ----------------------------------------------------------------------------- one epoch


def rank_sum(world: World) -> Callable[[torch.Tensor], None] | None:
    """Under torchrun: sum a tensor in place over every rank (a collective on the training group)."""
    if world.world_size == 1:
        return None

    def combine(t: torch.Tensor) -> None:
        import torch.distributed as dist

        with world.collectives():
            dist.all_reduce(t, group=world.group)

    return combine


def train_epoch(run: Run, epoch: int, progress: Progress | None = None) -> dict:
    """One pass over the training set. Reads the device once, at the end (with every rank's totals),
    and every CHECK_EVERY steps the running non-finite flag (FiniteWatch: no per-step sync, and
    on a GPU no wait), so that a diverged run stops within the epoch."""
    cfg, loader = run.cfg, run.train_loader
    loader.set_epoch(epoch)
    total_steps = cfg.epochs * len(loader)
    meter = Meter(run.devices[0])
    watch = FiniteWatch(meter, rank_sum(run.world))
    run.timer.reset()
    task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=len(loader)) if progress else None
    synchronize(run.devices)
    t0 = time.perf_counter()
    batches = iter(loader)
    for step in range(len(loader)):
        run.position = f"epoch {epoch + 1}, step {step + 1}/{len(loader)}"
        with run.timer.phase("data"):
            X, y = next(batches)
        if run.schedule_lr:
            run.strategy.set_lr(lr_at(epoch * len(loader) + step, total_steps, run.peak_lr, cfg.recipe_spec,
                                      run.warmup_steps))
        run.strategy.train_step(X, y, run.loss_fn, meter)
        if progress:
            progress.advance(task)
        if (step + 1) % CHECK_EVERY == 0 and step + 1 < len(loader):  # the last step: reduce reads it all
            seen = watch.poll(step + 1)
            if seen:  # every rank reads the same sum at the same step: all stop together
                raise NonFiniteLoss(f"epoch {epoch + 1}: the training loss became {seen[0]} by step {seen[1]}/{len(loader)}")
    stats = run.strategy.reduce(meter)  # also waits for the device: the epoch's time is complete
    synchronize(run.devices)
    seconds = time.perf_counter() - t0
    if progress:
        progress.remove_task(task)
    if not math.isfinite(stats["loss"]):  # every rank sees the same sum: all stop together
        raise NonFiniteLoss(f"epoch {epoch + 1}: the training loss became {stats['loss']}")
    phases = {name: [round(s, 4) for s in per_device] for name, per_device in run.timer.summary().items()}
    return {
        "train_loss": stats["loss"],
        "train_acc": stats["accuracy"] if run.loss_fn.classifies else None,
        "train_seconds": seconds,
        "samples_per_s": stats["count"] / seconds,
        "phases_s": phases,
        "allreduce_share": [s / seconds for s in phases.get("allreduce", [0.0])],
    }


def evaluate(run: Run) -> dict:
    t0 = time.perf_counter()
    result = run.strategy.evaluate(run.test_loader, run.loss_fn)
    accuracy = result["accuracy"] if run.loss_fn.classifies else None
    return {"test_loss": result["loss"], "test_acc": accuracy, "eval_seconds": time.perf_counter() - t0}


def epoch_line(row: dict, epochs: int, strategy: Strategy) -> str:
    if row["train_acc"] is None:  # not a classifier: the losses say it all
        metrics = f"loss {row['train_loss']:.4f}  test loss {row['test_loss']:.4f}"
    else:
        metrics = f"loss {row['train_loss']:.4f}  train acc {row['train_acc']:.3f}  test acc {row['test_acc']:.3f}"
    line = (f"epoch {row['epoch']:>2}/{epochs}  {metrics}  {row['train_seconds']:.1f} s  "
            f"{row['samples_per_s']:,.0f} samples/s")
    if strategy.num_replicas > 1:
        shares = "/".join(f"{s:.0%}" for s in row["allreduce_share"])
        line += f"  waiting for gradients {shares}"
    return line


def divergence(row: dict, history: list[dict]) -> str | None:
    """Why this epoch diverged (so it must not be kept as good), or None.

    The rule: an epoch is good when its training loss and its test loss are both finite and
    neither exceeds DIVERGENCE_FACTOR (100) x the run's first-epoch training loss; for the first
    epoch that is its own training loss. The first epoch's mean loss lies between the untrained
    model's and what it learnt, and a healthy run stays below it (overfitting raises the test loss
    a few times, not a hundred), so 100x means the run exploded. A reference <= 0 (a loss of the
    user's that can be negative) leaves only the finiteness rule."""
    reference = history[0]["train_loss"] if history else row["train_loss"]
    for key, name in (("train_loss", "training loss"), ("test_loss", "test loss")):
        value = row[key]
        if not math.isfinite(value):
            return f"the {name} became {value}"
        if math.isfinite(reference) and reference > 0 and value > DIVERGENCE_FACTOR * reference:
            return (f"the {name} became {value:.4g}, over {DIVERGENCE_FACTOR:g}x the first epoch's training loss "
                    f"({reference:.4g})")
    return None


def save_epoch(run_dir: RunDir, state: dict, history: list[dict]) -> None:
    """The checkpoint, then the metrics. A write that fails (a full disk, a folder gone) is one
    line that says what is intact: the file being replaced is, by atomic_write_bytes."""
    epoch = history[-1]["epoch"]
    try:
        run_dir.save_checkpoint({"strategy": state, "history": history, "epoch": epoch})
    except OSError as e:
        if len(history) > 1:
            kept = (f"the checkpoint of epoch {history[-2]['epoch']} is intact: free space, then gpulab train "
                    f"--resume {run_dir.path}")
        else:
            kept = f"no checkpoint was saved yet: free space, then start over with gpulab train --out {run_dir.path}"
        raise UserError(f"could not write epoch {epoch}'s checkpoint to {run_dir.path} ({e.strerror or e}); {kept}") from None
    try:
        run_dir.write_metrics(history)
    except OSError as e:
        raise UserError(f"epoch {epoch}'s checkpoint is saved in {run_dir.path} but its metrics could not be written "
                        f"({e.strerror or e}): free space, then gpulab train --resume {run_dir.path}") from None


def run_one_epoch(run: Run, epoch: int, progress: Progress, run_dir: RunDir, history: list[dict]) -> dict:
    """Train and evaluate one epoch, then checkpoint and write the metrics (appends to `history`).
    An epoch that diverged (`divergence`) is not kept: the last good checkpoint stays."""
    try:
        row = {"epoch": epoch + 1, **train_epoch(run, epoch, progress)}
        run.position = f"end of epoch {epoch + 1} (evaluation and checkpoint)"
        row.update(evaluate(run))
        why = divergence(row, history)  # the same numbers on every rank: all stop together
        if why:
            raise NonFiniteLoss(f"epoch {epoch + 1}: {why}")
    except NonFiniteLoss as e:
        # A checkpoint exists only once an epoch has finished; if the first one diverged
        # there is nothing to keep, and saying "epoch 0" would promise a file that isn't there.
        if history:
            kept = f"last good checkpoint (epoch {history[-1]['epoch']}) kept in {run_dir.path}: lower --lr"
        else:
            kept = (f"no checkpoint saved in {run_dir.path} (no epoch finished without diverging): start over there "
                    f"with a lower --lr (gpulab train --out {run_dir.path} ...)")
        raise SharedError(f"{e}; stopped, {kept}", printed_by=0) from None
    row["lr_peak"] = run.peak_lr
    row["replicas"] = run.strategy.num_replicas
    history.append(row)
    state = run.strategy.state_dict()  # collective: every rank takes part, rank 0 writes
    if run.world.is_main:
        save_epoch(run_dir, state, history)
    # The others wait here for rank 0's writes (within --timeout), so a failure meanwhile is
    # reported at the epoch's end, not as step 1 of the next.
    run.world.barrier()
    return row


# ----------------------------------------------------------------------------- the whole run


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
        f"{'bf16 autocast' if strategy.autocast else 'fp32'}, {strategy.description} -> {run_dir.path}"
        + ("\n--sync-bn has no effect here: this model has no BatchNorm layers" if no_batchnorm else "")
    )


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


def load_weights(run: Run, checkpoint: dict, run_dir: RunDir) -> None:
    """The checkpoint's state into the run, or one line when it was saved by another model."""
    try:
        run.strategy.load_state_dict(checkpoint["strategy"])
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


def resume_hint(run_dir: RunDir, history: list[dict], world: World) -> str:
    launcher = "the same torchrun command with " if world.world_size > 1 else ""
    if not history:  # nothing to resume: the same --out starts the run over in place
        again = "the same torchrun command" if world.world_size > 1 else f"gpulab train --out {run_dir.path}"
        return f"No checkpoint yet in {run_dir.path}; start over with {again}"
    return f"Last checkpoint: epoch {history[-1]['epoch']}, in {run_dir.path}; continue with {launcher}gpulab train --resume {run_dir.path}"


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
) -> dict:
    """Train as configured, or continue the run in directory `resume` with its saved config
    (`data_dir`: where its data is now, when it moved; `epochs`: a new total, to train on after
    the saved run's end; each replaces the saved value).

    Under torchrun (WORLD_SIZE > 1) this is one rank of the job: only rank 0 prints and writes.
    `train_data`/`test_data` (a Dataset or DataLoader each) replace Fashion-MNIST; `model` (an
    nn.Module), `loss_fn(outputs, labels) -> mean loss` and `optimizer` (params -> Optimizer)
    replace the built-in ones (see build()); a resumed run needs the same objects again. Returns
    the final epoch's metrics row.
    """
    world = from_environment()
    own = {"model": model, "loss_fn": loss_fn, "optimizer": optimizer}
    try:
        with claims():  # the run directory is this run's until it ends, however it ends
            return _train(world, cfg, resume, console, on_epoch_end, train_data, test_data, own, data_dir, epochs)
    except (PeerLost, Terminated) as e:  # before training began (the loop reports its own)
        raise world.failure(e, "set-up", "Nothing was trained yet") from None
    finally:
        world.close()


def _train(world: World, cfg, resume, console, on_epoch_end, train_data, test_data, own: dict, data_dir=None,
           epochs=None) -> dict:
    console = console or Console(highlight=False, soft_wrap=True)
    if not world.is_main:
        console = Console(quiet=True)
    checkpoint, saved_epochs = None, None
    if resume:
        run_dir = RunDir(Path(resume))

        def read_saved_run() -> dict:
            nonlocal checkpoint, saved_epochs  # read before build: a run with nothing to resume says so before loading data
            config = run_dir.read_config()
            run_dir.claim_for_resume()  # this run's from here on: a second one is refused
            checkpoint = run_dir.load_checkpoint()
            if data_dir is not None:
                config["data_dir"] = data_dir  # the data moved (made absolute by TrainConfig)
            saved_epochs = config.get("epochs")
            if epochs is not None:
                config["epochs"] = new_total_epochs(epochs, checkpoint["epoch"], saved_epochs, run_dir)
            return config

        # Validated on rank 0 (a damaged config.json is said once); the others get the checked dict.
        cfg = TrainConfig.from_dict(world.share("config", lambda: TrainConfig.from_dict(read_saved_run()).to_dict()))
    else:
        cfg = cfg or TrainConfig()
        if train_data is not None:
            cfg = dataclasses.replace(cfg, data="custom")  # config.json must not claim Fashion-MNIST
        if own["model"] is not None:
            cfg = dataclasses.replace(cfg, model=models.OBJECT)  # nor LeNet (nor the folder name)
        if data_dir is not None:
            cfg = dataclasses.replace(cfg, data_dir=data_dir)
        run_dir = RunDir(world.share("run-dir", lambda: new_run_dir(cfg)), unique=not cfg.out)
    run = build(cfg, world, train_data, test_data, **own)  # validates devices and data before anything is written
    world.all_or_none(lambda: check_data_sizes(run))

    history: list[dict] = []
    start_epoch = 0
    if resume:
        checkpoint = world.broadcast(checkpoint)  # only rank 0's machine needs to hold the run directory
        history, start_epoch = checkpoint["history"], checkpoint["epoch"]
        check_resumable(cfg, history, run.strategy.num_replicas)
        load_weights(run, checkpoint, run_dir)
        if world.is_main:
            try:
                if data_dir is not None or epochs is not None:
                    run_dir.write_config(run.cfg.to_dict())  # later resumes find the data, and the new total
                if history and run_dir.metrics_epochs() != [r["epoch"] for r in history]:
                    run_dir.write_metrics(history)  # a disk that filled up after the last checkpoint
            except OSError as e:
                raise UserError(f"--resume {run_dir.path}: cannot write there ({e.strerror or e}); free space or "
                                "fix the folder's permissions, then resume again") from None
    else:
        # Only now, everything built, is the directory written: claimed (locked for the run's life,
        # a default name made unique), then config.json with what build() learnt (input shape).
        run_dir.path = Path(world.share("run-dir-claimed", lambda: run_dir.start(run.cfg.to_dict())))

    if resume and start_epoch >= cfg.epochs:
        console.print(escape(f"{run_dir.path} is complete: {start_epoch} of {cfg.epochs} epochs trained; to train "
                             f"it further, give a new total: gpulab train --resume {run_dir.path} --epochs N"))
        return history[-1]
    console.print(escape(banner(run, run_dir)))
    if epochs is not None and epochs != saved_epochs and run.schedule_lr:  # (only rank 0 knows; only it prints)
        steps = len(run.train_loader)
        lr = lr_at(start_epoch * steps, cfg.epochs * steps, run.peak_lr, cfg.recipe_spec, run.warmup_steps)
        console.print(escape(f"extending from epoch {start_epoch} to {cfg.epochs}: the learning rate follows a "
                             f"{cfg.epochs}-epoch {cfg.recipe_spec.schedule} schedule from here (lr {lr:.3g} now)"))
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True, disable=not world.is_main,
    )
    # --profile: the same machinery as `gpulab profile`; report, timeline and trace go to <run>/profile.
    profiling = profile(out=run_dir.path / "profile", console=console) if cfg.profile and world.is_main else nullcontext()
    with profiling, progress:
        try:
            for epoch in range(start_epoch, cfg.epochs):
                row = run_one_epoch(run, epoch, progress, run_dir, history)
                console.print(escape(epoch_line(row, cfg.epochs, run.strategy)))
                if on_epoch_end:
                    on_epoch_end(row)
        except KeyboardInterrupt:
            if history:
                done = history[-1]["epoch"]
                console.print(escape(f"interrupted after epoch {done}: continue with gpulab train --resume {run_dir.path}"))
            else:  # no checkpoint: nothing to resume, but the same --out starts over in place
                console.print(escape(f"interrupted before the first checkpoint: start over with gpulab train --out "
                                     f"{run_dir.path} (and the same options)"))
            raise
        except (PeerLost, Terminated) as e:  # another rank failed: say which, where, and how to go on
            raise world.failure(e, f"{run.position}", resume_hint(run_dir, history, world)) from None
        except BaseException as e:
            world.report_failure(e)  # so the surviving ranks can name this rank and its reason
            raise

    final = history[-1]
    sec_per_epoch = sum(r["train_seconds"] for r in history) / len(history)
    result = f"test acc: {final['test_acc']:.3f}" if final["test_acc"] is not None else f"test loss: {final['test_loss']:.4g}"
    console.print(escape(f"{result}, {sec_per_epoch:.1f} sec/epoch on {placement(run)}"))
    return final
