"""Everything a run needs, built from a TrainConfig (and the caller's own data, model, loss,
optimizer): devices, data loaders, model, strategy, learning rate. Every check that can fail
runs here, before anything is written."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gpulab import data, models
from gpulab.config import TrainConfig
from gpulab.devices import for_rank, resolve
from gpulab.errors import UserError
from gpulab.host import fix_malloc_thresholds
from gpulab.options import flag, train_fields
from gpulab.parallel import DataParallel, World
from gpulab.parallel.distributed import DDPSync, Distributed
from gpulab.parallel.sharded import Sharded
from gpulab.parallel.strategy import Strategy
from gpulab.parallel.world import choose_backend
from gpulab.train.precision import autocast_dtype, compile_mode, use_channels_last
from gpulab.train.recipe import make_optimizer
from gpulab.train.step import CheckedLoss, PhaseTimer, Trainer


@dataclass
class Run:
    """Everything built from a config, ready to train."""

    cfg: TrainConfig
    world: World
    trainer: Trainer
    """The step (and evaluation) every strategy runs, with the strategy it runs through."""
    train_loader: data.DeviceLoader | data.HostLoader
    test_loader: data.DeviceLoader | data.HostLoader
    timer: PhaseTimer
    batch_size: int
    peak_lr: float
    warmup_steps: int
    schedule_lr: bool = True
    """The recipe's schedule sets the learning rate each step; a caller's own optimizer keeps its own."""
    compile: str = "off"
    """How the step runs: off, record, on or graphs: --compile, resolved (compile_mode)."""
    first_step_s: float | None = None
    """When this process's first training step ended, in seconds since the process started."""
    position: str = "set-up"
    """Where the loop is ("epoch 2, step 37"), for the message when another rank fails."""
    saved_epoch: int = 0
    """The last epoch whose checkpoint this rank knows is written (0: none), for the same message."""
    unconfirmed_epoch: int | None = None
    """On the other ranks, while rank 0 writes this epoch's checkpoint: whether it did, they learn at
    the barrier after it (a failure before then leaves them unsure)."""

    @property
    def strategy(self) -> Strategy:
        return self.trainer.strategy

    @property
    def loss_fn(self) -> CheckedLoss:
        return self.trainer.loss_fn

    @property
    def devices(self) -> list[torch.device]:
        return self.strategy.devices


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
    args = dict(device=device, seed=cfg.seed, rank=world.rank, world_size=world.world_size, channels_last=channels_last)
    return (
        data.user_loader(train_data, batch_size, train=True, **args),
        data.user_loader(test_data, cfg.eval_batch_size, train=False, **args),
    )


def check_image_shape(source, model: str) -> None:
    """Fail with one line, not a shape error deep inside forward, when images do not fit a built-in
    model (the user's own model takes whatever its data holds)."""
    if model not in models.MODELS:
        return
    shape = data.sample_shape(source)
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


def check_inputs(cfg: TrainConfig, world: World, batch_size: int, peak_lr: float, replicas: int, train_data,
                 test_data) -> None:
    check_peak_lr(cfg, peak_lr, replicas)
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
        data.check_pairs(train_data)
        data.check_pairs(test_data)
        check_image_shape(train_data, cfg.model)
    if isinstance(train_data, torch.utils.data.DataLoader) and world.world_size == 1:
        check_last_batch(train_data, replicas * cfg.accumulate)
    if cfg.shard == "fsdp":
        check_sharding(cfg, world)
    if cfg.sync_bn and world.world_size > 1 and cfg.sync == "ddp":
        raise UserError("--sync-bn with --sync ddp is not supported (gpulab's sync BN runs with --sync gpulab): drop one")
    if cfg.recipe_spec.init == "textbook" and cfg.model != "lenet":
        raise UserError("--recipe textbook initialises the textbook's LeNet only: use --model lenet")


def check_last_batch(loader: torch.utils.data.DataLoader, parts: int) -> None:
    """A DataLoader used as it is (one process) must give each of the `parts` its batches are split
    into (devices x micro-batches) a sample - its last, partial batch too."""
    if loader.drop_last or loader.batch_size is None or parts <= 1:
        return
    try:
        n = len(loader.sampler)
    except TypeError:
        return
    last = n % loader.batch_size
    if 0 < last < parts:
        raise UserError(f"train_data's last batch holds {last} sample(s) ({n} in batches of {loader.batch_size}), "
                        f"fewer than the {parts} parts each batch is split into (devices x micro-batches): pass "
                        "DataLoader(..., drop_last=True)")


def check_peak_lr(cfg: TrainConfig, peak_lr: float, replicas: int) -> None:
    """The optimizer steps the float32 weights with the learning rate converted to float32: one past
    float32's largest number cannot be converted, and the first step would fail deep in torch."""
    largest = torch.finfo(torch.float32).max
    if peak_lr <= largest:
        return
    lr = cfg.lr if cfg.lr is not None else cfg.recipe_spec.lr
    scaled = cfg.scale_batch and replicas > 1
    given = f"--lr {lr:g} x {replicas} devices (--scale-batch) is {peak_lr:g}," if scaled else f"--lr {lr:g} is"
    raise UserError(f"{given} beyond float32's largest number ({largest:.4g}), the type the weights are stepped "
                    f"in: use --lr {largest * lr / peak_lr:.3g} or less")


def check_options_apply(cfg: TrainConfig, world: World) -> None:
    """A new run's options that act only under torchrun, or only in one process, given where they
    do nothing: refused rather than recorded in config.json as if they had acted."""
    defaults = TrainConfig()
    if world.world_size == 1:
        given = [f"--{name} {value}" for name, value in (("sync", cfg.sync), ("backend", cfg.backend),
                                                          ("timeout", f"{cfg.timeout:g}"))
                 if getattr(cfg, name) != getattr(defaults, name)]
        if given:
            raise UserError(f"{', '.join(given)}: for torchrun ranks, and this is one process: start it with gpulab "
                            "launch -n K (or torchrun), or drop it (in one process --devices cpu*K or cuda:0,cuda:1 "
                            "replicates the model, and --allreduce says how their gradients meet)")
    elif cfg.allreduce != defaults.allreduce:
        raise UserError(f"--allreduce {cfg.allreduce}: for several devices in one process; torchrun ranks exchange "
                        "gradients over --backend: drop --allreduce")


def check_sharding(cfg: TrainConfig, world: World) -> None:
    """--shard fsdp shards over torchrun ranks, one device each, with FSDP's own gradient exchange."""
    if world.world_size == 1:
        raise UserError("--shard fsdp shards the model over torchrun ranks: start it with torchrun --nproc-per-node K "
                        "-m gpulab train --shard fsdp (or gpulab launch); in one process, --devices cpu*K or "
                        "cuda:0,cuda:1 replicates the model instead")
    if cfg.sync_bn:
        raise UserError("--sync-bn with --shard fsdp is not supported (gpulab's sync BN runs with replicated "
                        "models): drop --sync-bn, and each rank's BatchNorm statistics are averaged at evaluation")
    if cfg.sync == "ddp":
        raise UserError("--sync ddp replicates the model; --shard fsdp exchanges gradients its own way "
                        "(reduce-scatter): drop one")
    if cfg.channels_last == "on":
        raise UserError("--channels-last on with --shard fsdp: FSDP2 shards contiguous (NCHW) parameters only; "
                        "drop --channels-last")


def make_strategy(cfg: TrainConfig, world: World, model: torch.nn.Module, devices: list[torch.device],
                  batch_size: int, lr: float, optimizer=None, compile: str = "off") -> Strategy:
    """`compile`: off, record, on or graphs (compile_mode's answer); a compiled or recorded step
    steps the recipe's optimizer fused (a caller's own optimizer is left as given), except on FSDP's sharded
    parameters (DTensors), which torch's fused SGD does not take: its foreach step there."""
    sharded = world.world_size > 1 and cfg.shard == "fsdp"
    optimizer = optimizer or make_optimizer(cfg.recipe_spec, lr, fused=compile != "off" and not sharded)
    if sharded:
        return Sharded(model, world, devices[0], batch_size, optimizer,
                       param_dtype=autocast_dtype(cfg, devices, compile))
    if world.world_size > 1 and cfg.sync == "ddp":
        return DDPSync(model, world, devices[0], batch_size, optimizer)
    if world.world_size > 1:
        return Distributed(model, world, devices[0], batch_size, optimizer, sync_bn=cfg.sync_bn)
    return DataParallel(model, devices, optimizer=optimizer, allreduce=cfg.allreduce, sync_bn=cfg.sync_bn)


def checked_factory(factory):
    """The caller's optimizer factory, whose every result is checked: gpulab builds one optimizer
    per replica, on that replica's parameters, so an optimizer already built (on the caller's
    model) cannot serve, and a factory must return one."""
    example = "optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
    if isinstance(factory, torch.optim.Optimizer):
        raise UserError(f"optimizer= takes a factory params -> Optimizer, not a {type(factory).__name__} already "
                        f"built on the model's parameters (gpulab builds one per replica): {example}")
    if not callable(factory):
        raise UserError(f"optimizer= takes a factory params -> Optimizer, not a {type(factory).__name__}: {example}")

    def make(params):
        made = factory(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise UserError(f"the optimizer factory returned {type(made).__name__}, not a torch.optim.Optimizer: "
                            f"{example}")
        return made

    return make


def check_own_model(model: torch.nn.Module) -> None:
    models.check_trainable(model, "the model passed to train()")
    devices = {p.device for p in model.parameters()} | {b.device for b in model.buffers()}
    if len(devices) > 1:
        listing = ", ".join(sorted(str(d) for d in devices))
        raise UserError(f"the model's parameters are on several devices ({listing}): gpulab places one whole copy "
                        "per device itself - pass the model on one device (e.g. model.cpu())")


# Options that may differ between machines: where the data and the run directory are, which
# local devices, whether this machine's ranks are profiled. Every other option must be equal.
PER_MACHINE_OPTIONS = ("data_dir", "devices", "out", "profile")


def options_to_agree_on(cfg: TrainConfig) -> dict[str, str]:
    values = cfg.to_dict()
    return {flag(name): "(default)" if values[name] is None else str(values[name])
            for name in train_fields() if name not in PER_MACHINE_OPTIONS}


def build(cfg: TrainConfig, world: World | None = None, train_data=None, test_data=None,
          model: torch.nn.Module | None = None, loss_fn=None, optimizer=None) -> Run:
    """Everything a run needs. `train_data`/`test_data`: a Dataset or DataLoader of (input, label)
    to train on instead of Fashion-MNIST (the built-in data is loaded only when they are None).
    `model`: your own nn.Module instead of `cfg.model`; `loss_fn(outputs, labels)`: the batch's
    mean loss (default: cross-entropy); `optimizer`: a factory `params -> torch.optim.Optimizer`
    (default: the recipe's, with its learning-rate schedule; yours keeps its own learning rate)."""
    world = world or World()
    own_parts = any(part is not None for part in (model, loss_fn, optimizer))  # gpulab cannot vouch for them
    fix_malloc_thresholds()  # before the data is loaded: every step then reuses freed host memory
    if model is not None:
        check_own_model(model)
        cfg = dataclasses.replace(cfg, model=models.OBJECT)  # the run's config must not claim LeNet
    if optimizer is not None:
        optimizer = checked_factory(optimizer)
    world.agree(options_to_agree_on(cfg), "gpulab train options")
    # Every check that needs no data runs before the first collective, on every rank together.
    devices = world.all_or_none(lambda: choose_devices(cfg, world))
    replicas = len(devices) * world.world_size
    recipe = cfg.recipe_spec
    batch_size = global_batch_size(cfg, replicas, train_data)
    peak_lr = (cfg.lr or recipe.lr) * (replicas if cfg.scale_batch else 1)
    world.all_or_none(lambda: check_inputs(cfg, world, batch_size, peak_lr, replicas, train_data, test_data))
    world.connect(devices[0], cfg.backend, cfg.timeout)
    if train_data is None:
        # One rank per machine finds (or downloads) the files first; the others then read them.
        train_data, test_data = world.local_main_first(lambda: data.load(cfg.data_dir, download=True))
    shape = data.sample_shape(train_data)
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

    compile = world.all_or_none(lambda: compile_mode(cfg, devices, world.world_size, own_parts))
    timer = PhaseTimer(devices)
    strategy = make_strategy(cfg, world, model, devices, batch_size, peak_lr, optimizer, compile)
    loss_fn = CheckedLoss(loss_fn or torch.nn.CrossEntropyLoss(label_smoothing=recipe.label_smoothing))
    # A sharded model's precision is FSDP's policy, not autocast's.
    autocast = None if isinstance(strategy, Sharded) else autocast_dtype(cfg, devices, compile)
    trainer = Trainer(strategy, loss_fn, autocast, cfg.accumulate, compile, timer)
    # Linear scaling needs a warm-up: a k-times larger lr from step 0 diverges (Goyal et al. 2017).
    warmup_steps = len(train_loader) if cfg.scale_batch and replicas > 1 else 0
    return Run(
        cfg=cfg,
        world=world,
        trainer=trainer,
        train_loader=train_loader,
        test_loader=test_loader,
        timer=timer,
        batch_size=batch_size,
        peak_lr=peak_lr,
        warmup_steps=warmup_steps,
        schedule_lr=optimizer is None,
        compile=compile,
    )
