"""What a training run is: one dataclass for the run, one for the optimisation recipe.

Torch-free, so that the command line is built from TrainConfig's fields before torch is imported.
"""

from __future__ import annotations

import functools
import json
import math
import os
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

from gpulab.errors import UserError

# The choices of each option, declared once: TrainConfig checks them, --help lists them.
Dataset = Literal["fashion-mnist", "custom"]
RecipeName = Literal["modern", "textbook"]
Allreduce = Literal["auto", "naive", "ring", "nccl"]
Sync = Literal["gpulab", "ddp"]
Shard = Literal["none", "fsdp"]
Backend = Literal["auto", "gloo", "nccl"]
ChannelsLast = Literal["auto", "on", "off"]
Precision = Literal["auto", "fp32", "bf16"]
Compile = Literal["auto", "off", "on", "graphs", "record"]


MAX_TIMEOUT_S = 24 * 3600.0
"""The longest --timeout: a rank silent for a day is gone (and timedelta overflows near 1e14 s)."""

MAX_SEED = 2**32 - 1
"""Seeds are 32-bit, as in NumPy (the sampling order is drawn from seed x 1000003 + epoch, which must fit in 64 bits)."""


@dataclass(kw_only=True)
class Recipe:
    """How the model is optimised. Two named recipes live in RECIPES."""

    name: str
    lr: float
    """Peak learning rate."""
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    schedule: Literal["constant", "onecycle"] = "constant"
    """'constant', or 'onecycle': linear warm-up to `lr` over `warmup_frac` of the steps, then cosine to 0."""
    warmup_frac: float = 0.0
    init: Literal["default", "textbook"] = "default"
    """'default' (PyTorch's) or 'textbook' (every weight ~ N(0, 0.01^2), biases 0)."""
    normalize: bool = False
    """Standardise pixels with the training set's mean/std (False: pixels in [0, 1], like ToTensor)."""


RECIPES: dict[RecipeName, Recipe] = {
    # The multi-GPU chapter's setting: plain minibatch SGD, lr 0.2, batch 256, N(0, 0.01^2) init.
    "textbook": Recipe(name="textbook", lr=0.2, init="textbook"),
    # Measured on Fashion-MNIST/LeNet, 10 epochs, 2-core CPU: test acc 0.906 (bf16) / 0.908
    # (fp32), where the textbook recipe reaches 0.836. Every ingredient is standard: Nesterov
    # momentum, one-cycle schedule, label smoothing, standardised inputs, light weight decay.
    "modern": Recipe(
        name="modern",
        lr=0.1,
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-4,
        label_smoothing=0.1,
        schedule="onecycle",
        warmup_frac=0.15,
        normalize=True,
    ),
}


def option(default, help: str, cli: bool = True):
    """A TrainConfig field: its default and its --help text. `gpulab train`'s options are built from
    these fields (gpulab.options), so each option is declared here and nowhere else."""
    return field(default=default, metadata={"help": help, "cli": cli})


@dataclass(kw_only=True)
class TrainConfig:
    """What a training run is. Every field but input_shape is an option of `gpulab train`."""

    model: str = option("lenet", "lenet, resnet18, or your own: package.module:factory (a callable returning an "
                        "nn.Module that takes 1x28x28 images and gives 10 class scores)")
    input_shape: list[int] | None = option(None, "one sample's input shape (no batch dimension), recorded from "
                                           "the training data for export", cli=False)
    data: Dataset = option("fashion-mnist", "dataset (custom: your own, given to train() from Python)")
    data_dir: str | None = option(None, "folder with the IDX files (default: $GPULAB_DATA, the cache dir, then "
                                  "Debian's path); stored absolute, so that a resumed run finds it from anywhere")
    devices: str = option("auto", "auto or all (every GPU, else the CPU) | cpu | cpu*K | cuda:0,cuda:1 | gpu:N")
    epochs: int = option(10, "number of epochs")
    batch_size: int = option(256, "GLOBAL minibatch size: with k devices each device gets about batch-size/k")
    lr: float | None = option(None, "peak learning rate (default: the recipe's)")
    recipe: RecipeName = option("modern", "modern, or textbook (SGD, lr 0.2, the chapter's N(0, 0.01^2) init)")
    seed: int = option(0, "seed of the initial weights and the batch order")
    allreduce: Allreduce = option("auto", "gradient allreduce in one process over k devices")
    sync: Sync = option("gpulab", "under torchrun: gpulab (bucketed all-reduce overlapped with backward) or "
                        "ddp (PyTorch's DistributedDataParallel)")
    shard: Shard = option("none", "under torchrun: none (every rank holds the whole model, gradients and optimizer "
                          "state) or fsdp (each rank holds 1/k of them: torch's FSDP2, for a model that does "
                          "not fit)")
    backend: Backend = option("auto", "under torchrun: auto (nccl when each rank has a GPU, else gloo), gloo or nccl")
    timeout: float = option(60.0, "under torchrun: seconds a training collective waits for the other ranks "
                            "before the job stops (it must cover rank 0 writing a checkpoint)")
    accumulate: int = option(1, "compute each batch as N micro-batches in turn, exchanging gradients once per step")
    sync_bn: bool = option(False, "BatchNorm statistics over the whole minibatch")
    scale_batch: bool = option(False, "multiply the batch and the learning rate by the number of devices "
                               "(with one epoch of warm-up)")
    eval_batch_size: int = option(1024, "batch size of evaluation: no gradients, so it can be larger")
    channels_last: ChannelsLast = option("auto", "auto: on for CPU, where it is measured faster")
    precision: Precision = option("auto", "auto: bf16 autocast where it is measured faster - on CPUs with native "
                                  "bf16, and on bf16 GPUs where the step is a CUDA graph (record, graphs); else fp32")
    compile: Compile = option("auto", "how the step runs: off (eager), record (one GPU: the eager step recorded once "
                              "as a CUDA graph and replayed, nothing compiled), on (torch.compile: forward, loss and "
                              "backward as compiled graphs, a fused optimizer), graphs (CUDA only: on + CUDA graphs; "
                              "on one GPU the whole compiled step recorded once); auto: record on one GPU for "
                              "gpulab's own models, else off (measured: compiling costs a short run more than it wins)")
    out: str | None = option(None, "run directory (default runs/<timestamp>-<model>)")
    profile: bool = option(False, "sample utilisation and write a timeline, report and trace to <run dir>/profile/")

    def __post_init__(self):
        from gpulab.models import check_spec

        check_spec(self.model)
        check_choices(self)
        if self.epochs < 1:
            raise UserError(f"--epochs {self.epochs}: train for at least 1 epoch")
        if not (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED):
            raise UserError(f"--seed {self.seed}: out of range; use a whole number from 0 to {MAX_SEED}")
        # An empty path (a shell variable never set) would silently mean the default, or the
        # current folder: never what the user meant.
        for name in ("out", "data_dir"):
            if getattr(self, name) is not None and not getattr(self, name).strip():
                raise UserError(f"--{name.replace('_', '-')} '': an empty path; give a folder, or leave the option out")
        if self.data_dir is not None:
            self.data_dir = os.path.abspath(os.path.expanduser(self.data_dir))
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size}: the batch size must be >= 1")
        if self.eval_batch_size < 1:
            raise UserError(f"--eval-batch-size {self.eval_batch_size}: must be >= 1")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr {self.lr}: the learning rate must be a positive number")
        if not 0 < self.timeout <= MAX_TIMEOUT_S:  # nan fails the comparison too
            raise UserError(f"--timeout {self.timeout}: give the collective timeout in seconds, > 0 and at most "
                            f"{MAX_TIMEOUT_S:g} (a day)")
        if self.accumulate < 1:
            raise UserError(f"--accumulate {self.accumulate}: use 1 (no accumulation) or more micro-batches per step")

    @property
    def recipe_spec(self) -> Recipe:
        return RECIPES[self.recipe]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """A saved config (config.json, or one rank's copy of it): every field checked for its
        type before any is used, since a file may come from anywhere."""
        hints = typing.get_type_hints(cls)
        known = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
        for name, value in known.items():
            check_type(name, value, hints[name])
        return cls(**known)


def check_type(name: str, value, hint) -> None:
    """One line unless `value` fits the field's annotation: a hand-edited or crafted config.json
    (epochs 2.5, model 123) would otherwise fail deep inside the run with a traceback."""
    if not fits(value, hint):
        shown = json.dumps(value)  # as config.json has it
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise UserError(f"config.json: {name} is {shown}, not {describe(hint)}; restore the original file or start a "
                        "new run")


def fits(value, hint) -> bool:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return isinstance(value, str) and value in args
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, arg) for arg in args)
    if origin is list:
        return isinstance(value, list) and all(fits(v, args[0]) for v in value)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, hint)


def describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(arg) for arg in args)
    if origin is list:
        return f"a list of {describe(args[0]).removeprefix('a ')}s"
    names = {type(None): "null", bool: "true or false", int: "a whole number", float: "a number", str: "text"}
    return names.get(hint, hint.__name__)


@functools.cache
def literal_choices(cls: type) -> dict[str, tuple[str, ...]]:
    """{field: the values it may take} for the Literal-typed fields of dataclass `cls`."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in fields(cls) if typing.get_origin(hints[f.name]) is Literal}


def check_choices(obj) -> None:
    """Every Literal-typed field holds one of its values, or a one-line error that lists them."""
    for name, allowed in literal_choices(type(obj)).items():
        value = getattr(obj, name)
        if value not in allowed:
            raise UserError(f"--{name.replace('_', '-')} {value}: choose one of {', '.join(allowed)}")
