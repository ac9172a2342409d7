"""The training loop: build everything from a TrainConfig, then epoch after epoch,
batch -> shards -> forward/backward -> allreduce -> update, with the running metrics on the
device and one host read per epoch.
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
from gpulab.devices import format_devices, resolve
from gpulab.errors import UserError
from gpulab.monitor import profile
from gpulab.monitor.phases import PhaseTimer
from gpulab.parallel import DataParallel, Meter
from gpulab.train.config import Recipe, TrainConfig
from gpulab.train.rundir import RunDir, check_writable, default_run_dir


class NonFiniteLoss(RuntimeError):
    pass


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
    devices: list[torch.device]
    strategy: DataParallel
    train_loader: data.DeviceLoader | data.HostLoader
    test_loader: data.DeviceLoader | data.HostLoader
    loss_fn: torch.nn.Module
    timer: PhaseTimer
    batch_size: int
    peak_lr: float
    warmup_steps: int


def user_loader(source, batch_size: int, device: torch.device, shuffle: bool, channels_last: bool) -> data.HostLoader:
    """A user's own Dataset (batched here) or DataLoader, copied batch by batch to `device`."""
    if not hasattr(source, "__len__"):
        raise UserError("train_data/test_data must have a length (a map-style Dataset or a DataLoader over one)")
    if isinstance(source, torch.utils.data.Dataset) and not isinstance(source, torch.utils.data.IterableDataset):
        # Pinned host memory lets the copy to the GPU run asynchronously (non_blocking).
        source = torch.utils.data.DataLoader(source, batch_size, shuffle=shuffle, pin_memory=device.type == "cuda")
    return data.HostLoader(source, device, channels_last=channels_last)


def check_image_shape(source, model: str) -> None:
    """Fail with one line, not a shape error deep inside forward, when images do not fit the model."""
    dataset = source if isinstance(source, torch.utils.data.Dataset) else getattr(source, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or len(dataset) == 0:
        return  # nothing to look at without consuming the user's iterator
    shape = tuple(torch.as_tensor(dataset[0][0]).shape)
    fits = len(shape) == 3 and shape[0] == 1 and (model != "lenet" or shape[1:] == (28, 28))
    if not fits:
        want = "1x28x28" if model == "lenet" else "1xHxW"
        raise UserError(f"train_data images have shape {'x'.join(map(str, shape))}; --model {model} takes {want} images")


def build(cfg: TrainConfig, train_data=None, test_data=None) -> Run:
    """Everything a run needs. `train_data`/`test_data`: a Dataset or DataLoader of (image, label)
    to train on instead of Fashion-MNIST (the built-in data is loaded only when they are None)."""
    devices = resolve(cfg.devices)
    k = len(devices)
    recipe = cfg.recipe_spec
    batch_size = cfg.batch_size * (k if cfg.scale_batch else 1)
    peak_lr = (cfg.lr or recipe.lr) * (k if cfg.scale_batch else 1)
    if batch_size < k:
        raise UserError(f"--batch-size {cfg.batch_size} is smaller than the {k} devices: use at least {k}")
    if (train_data is None) != (test_data is None):
        raise UserError("pass both train_data and test_data, or neither (to use Fashion-MNIST)")
    if cfg.data == "custom" and train_data is None:
        raise UserError("this run trains on the caller's own data: pass train_data and test_data to train()")
    channels_last = use_channels_last(cfg, devices)
    loader_args = dict(device=devices[0], channels_last=channels_last)
    if train_data is None:
        train_split, test_split = data.load(cfg.data_dir, download=True)
        train_loader = data.DeviceLoader(
            train_split, batch_size, shuffle=True, seed=cfg.seed, normalize=recipe.normalize, **loader_args
        )
        test_loader = data.DeviceLoader(test_split, cfg.eval_batch_size, normalize=recipe.normalize, **loader_args)
    else:
        check_image_shape(train_data, cfg.model)
        train_loader = user_loader(train_data, batch_size, shuffle=True, **loader_args)
        test_loader = user_loader(test_data, cfg.eval_batch_size, shuffle=False, **loader_args)

    torch.manual_seed(cfg.seed)
    model = models.build(cfg.model)
    if recipe.init == "textbook":
        if not isinstance(model, models.LeNet):
            raise UserError("--recipe textbook initialises the textbook's LeNet only: use --model lenet")
        model.init_textbook()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    for d in devices:
        if d.type == "cuda":
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick its fastest kernels

    timer = PhaseTimer(devices)
    strategy = DataParallel(
        model, devices, optimizer=make_optimizer(recipe, peak_lr), allreduce=cfg.allreduce, sync_bn=cfg.sync_bn,
        timer=timer, autocast=autocast_dtype(cfg, devices),
    )
    # Linear scaling needs a warm-up: a k-times larger lr from step 0 diverges (Goyal et al. 2017).
    warmup_steps = len(train_loader) if cfg.scale_batch and k > 1 else 0
    return Run(
        cfg=cfg,
        devices=devices,
        strategy=strategy,
        train_loader=train_loader,
        test_loader=test_loader,
        loss_fn=torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing),
        timer=timer,
        batch_size=batch_size,
        peak_lr=peak_lr,
        warmup_steps=warmup_steps,
    )


def train_epoch(run: Run, epoch: int, progress: Progress | None = None) -> dict:
    """One pass over the training set. Reads the device once, at the end."""
    cfg, loader = run.cfg, run.train_loader
    loader.set_epoch(epoch)
    total_steps = cfg.epochs * len(loader)
    meter = Meter(run.devices[0])
    run.timer.reset()
    task = progress.add_task(f"epoch {epoch + 1}/{cfg.epochs}", total=len(loader)) if progress else None
    synchronize(run.devices)
    t0 = time.perf_counter()
    batches = iter(loader)
    for step in range(len(loader)):
        with run.timer.phase("data"):
            X, y = next(batches)
        if len(y) < len(run.devices):
            continue  # a last batch smaller than k cannot be split; its samples come back next epoch
        run.strategy.set_lr(lr_at(epoch * len(loader) + step, total_steps, run.peak_lr, cfg.recipe_spec, run.warmup_steps))
        run.strategy.train_step(X, y, run.loss_fn, meter)
        if progress:
            progress.advance(task)
    synchronize(run.devices)
    seconds = time.perf_counter() - t0
    if progress:
        progress.remove_task(task)
    stats = meter.read()
    if not math.isfinite(stats["loss"]):
        raise NonFiniteLoss(f"epoch {epoch + 1}: the training loss became {stats['loss']}")
    phases = {name: [round(s, 4) for s in per_device] for name, per_device in run.timer.summary().items()}
    return {
        "train_loss": stats["loss"],
        "train_acc": stats["accuracy"],
        "train_seconds": seconds,
        "samples_per_s": stats["count"] / seconds,
        "phases_s": phases,
        "allreduce_share": [s / seconds for s in phases.get("allreduce", [0.0])],
    }


def evaluate(run: Run) -> dict:
    t0 = time.perf_counter()
    result = run.strategy.evaluate(run.test_loader, run.loss_fn)
    return {"test_loss": result["loss"], "test_acc": result["accuracy"], "eval_seconds": time.perf_counter() - t0}


def epoch_line(row: dict, epochs: int, devices: list[torch.device]) -> str:
    line = (
        f"epoch {row['epoch']:>2}/{epochs}  loss {row['train_loss']:.4f}  train acc {row['train_acc']:.3f}  "
        f"test acc {row['test_acc']:.3f}  {row['train_seconds']:.1f} s  {row['samples_per_s']:,.0f} samples/s"
    )
    if len(devices) > 1:
        shares = "/".join(f"{s:.0%}" for s in row["allreduce_share"])
        line += f"  {format_devices(devices)} allreduce {shares}"
    return line


def run_one_epoch(run: Run, epoch: int, progress: Progress, run_dir: RunDir, history: list[dict]) -> dict:
    """Train and evaluate one epoch, then checkpoint and write the metrics (appends to `history`)."""
    try:
        row = {"epoch": epoch + 1, **train_epoch(run, epoch, progress), **evaluate(run)}
    except NonFiniteLoss as e:
        # A checkpoint exists only once an epoch has finished; if the first one diverged
        # there is nothing to keep, and saying "epoch 0" would promise a file that isn't there.
        if history:
            kept = f"last good checkpoint (epoch {history[-1]['epoch']}) kept in {run_dir.path}"
        else:
            kept = f"no checkpoint saved in {run_dir.path} (no epoch finished with a finite loss)"
        raise UserError(f"{e}; stopped, {kept}: lower --lr") from None
    row["lr_peak"] = run.peak_lr
    history.append(row)
    run_dir.save_checkpoint({"strategy": run.strategy.state_dict(), "history": history, "epoch": epoch + 1})
    run_dir.write_metrics(history)
    return row


def train(
    cfg: TrainConfig | None = None,
    resume: str | None = None,
    console: Console | None = None,
    on_epoch_end: Callable[[dict], None] | None = None,
    train_data=None,
    test_data=None,
) -> dict:
    """Train as configured, or continue the run in directory `resume` with its saved config.

    `train_data`/`test_data` (a Dataset or DataLoader each) replace Fashion-MNIST; a resumed run
    needs them again. Returns the final epoch's metrics row.
    """
    console = console or Console(highlight=False, soft_wrap=True)
    if resume:
        run_dir = RunDir(Path(resume))
        cfg = TrainConfig.from_dict(run_dir.read_config())
        # Before build: a run with nothing to resume should say so, not load (or download) data first.
        checkpoint = run_dir.load_checkpoint()
    else:
        cfg = cfg or TrainConfig()
        if train_data is not None:
            cfg = dataclasses.replace(cfg, data="custom")  # config.json must not claim Fashion-MNIST
        run_dir = RunDir(Path(cfg.out) if cfg.out else default_run_dir(cfg.model))
        check_writable(run_dir.path)
    run = build(cfg, train_data, test_data)  # validates devices and data before anything is written

    history: list[dict] = []
    start_epoch = 0
    if resume:
        run.strategy.load_state_dict(checkpoint["strategy"])
        history, start_epoch = checkpoint["history"], checkpoint["epoch"]
    else:
        run_dir.create()
        run_dir.write_config(cfg.to_dict())

    console.print(escape(
        f"training {cfg.model} on {format_devices(run.devices)}: {cfg.epochs} epochs, batch {run.batch_size} "
        f"(~{run.batch_size // len(run.devices)} per device), recipe {cfg.recipe}, lr {run.peak_lr:g}, "
        f"{'bf16 autocast' if run.strategy.autocast else 'fp32'}, "
        f"allreduce {run.strategy.allreduce_algorithm} -> {run_dir.path}"
    ))
    progress = Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
        console=console, transient=True,
    )
    # --profile: the same machinery as `gpulab profile`; report, timeline and trace go to <run>/profile.
    profiling = profile(out=run_dir.path / "profile", console=console) if cfg.profile else nullcontext()
    with profiling, progress:
        try:
            for epoch in range(start_epoch, cfg.epochs):
                row = run_one_epoch(run, epoch, progress, run_dir, history)
                console.print(escape(epoch_line(row, cfg.epochs, run.devices)))
                if on_epoch_end:
                    on_epoch_end(row)
        except KeyboardInterrupt:
            done = history[-1]["epoch"] if history else 0
            console.print(escape(f"interrupted after epoch {done}: continue with gpulab train --resume {run_dir.path}"))
            raise

    final = history[-1]
    sec_per_epoch = sum(r["train_seconds"] for r in history) / len(history)
    console.print(escape(f"test acc: {final['test_acc']:.2f}, {sec_per_epoch:.1f} sec/epoch on {format_devices(run.devices)}"))
    return final
