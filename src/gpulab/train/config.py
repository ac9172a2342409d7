"""What a training run is: one dataclass for the run, one for the optimisation recipe."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields

from gpulab.errors import UserError


MAX_SEED = 2**32 - 1
"""Seeds are 32-bit, as in NumPy (the sampling order is drawn from seed x 1000003 + epoch, which must fit in 64 bits)."""


@dataclass(kw_only=True)
class Recipe:
    """How the model is optimised. Two named recipes live in RECIPES."""

    name: str
    lr: float
    """Peak learning rate (for a batch of `base_batch_size`)."""
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    schedule: str = "constant"
    """'constant', or 'onecycle': linear warm-up to `lr` over `warmup_frac` of the steps, then cosine to 0."""
    warmup_frac: float = 0.0
    init: str = "default"
    """'default' (PyTorch's) or 'textbook' (every weight ~ N(0, 0.01^2), biases 0)."""
    normalize: bool = False
    """Standardise pixels with the training set's mean/std (False: pixels in [0, 1], like ToTensor)."""


RECIPES = {
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


@dataclass(kw_only=True)
class TrainConfig:
    model: str = "lenet"
    """lenet | resnet18 | package.module:factory (your own nn.Module) | custom (an nn.Module passed to train())"""
    input_shape: list[int] | None = None
    """One sample's input shape (no batch dimension), recorded from the training data for export."""
    data: str = "fashion-mnist"
    """fashion-mnist, or custom when train() is given the caller's own Dataset/DataLoader."""
    data_dir: str | None = None
    """Folder with the four IDX files (stored absolute, so a resumed run finds it from any working
    directory); default: $GPULAB_DATA, the cache dir, then Debian's path."""
    devices: str = "auto"
    """auto | cpu | cpu*K | cuda:0,cuda:1 | gpu:N"""
    epochs: int = 10
    batch_size: int = 256
    """The global minibatch: with k devices each one gets about batch_size/k samples."""
    lr: float | None = None
    """Peak learning rate; default: the recipe's."""
    recipe: str = "modern"
    seed: int = 0
    allreduce: str = "auto"
    """In one process over k devices: auto | naive | ring | nccl."""
    sync: str = "gpulab"
    """Under torchrun: gpulab (bucketed all-reduce overlapped with backward) | ddp (PyTorch's DistributedDataParallel)."""
    backend: str = "auto"
    """Under torchrun: auto (nccl when each rank has a GPU, else gloo) | gloo | nccl."""
    timeout: float = 60.0
    """Under torchrun: seconds a training collective may wait for another rank before the job stops
    (the other ranks also wait this long at most for rank 0 to write a checkpoint)."""
    accumulate: int = 1
    """Compute each batch as this many micro-batches in turn; gradients are exchanged once, after the last."""
    sync_bn: bool = False
    scale_batch: bool = False
    """Multiply the batch by k and the learning rate by k (linear scaling, with warm-up)."""
    eval_batch_size: int = 1024
    channels_last: str = "auto"
    """auto (on for CPU, where it is measured faster) | on | off"""
    precision: str = "auto"
    """auto (bf16 autocast on CPUs with native bf16, where it is measured faster; else fp32) | fp32 | bf16"""
    out: str | None = None
    """Run directory; default runs/<timestamp>-<model>."""
    profile: bool = False
    """Sample device/process utilisation during the run and write a timeline."""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        from gpulab.models import check_spec

        check_spec(self.model)
        if self.data not in ("fashion-mnist", "custom"):  # custom: Dataset/DataLoader passed to train()
            raise UserError(f"--data {self.data}: unknown dataset; gpulab train supports fashion-mnist")
        if self.recipe not in RECIPES:
            raise UserError(f"--recipe {self.recipe}: unknown recipe; choose one of {', '.join(RECIPES)}")
        if self.epochs < 1:
            raise UserError(f"--epochs {self.epochs}: train for at least 1 epoch")
        if not (isinstance(self.seed, int) and abs(self.seed) <= MAX_SEED):
            raise UserError(f"--seed {self.seed}: out of range; use a whole number from 0 to {MAX_SEED}")
        if self.data_dir is not None:
            self.data_dir = os.path.abspath(os.path.expanduser(self.data_dir))
        if self.batch_size < 1:
            raise UserError(f"--batch-size {self.batch_size}: the batch size must be >= 1")
        if self.eval_batch_size < 1:
            raise UserError(f"--eval-batch-size {self.eval_batch_size}: must be >= 1")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"--lr {self.lr}: the learning rate must be a positive number")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise UserError(f"--precision {self.precision}: use auto, fp32 or bf16")
        if self.channels_last not in ("auto", "on", "off"):
            raise UserError(f"--channels-last {self.channels_last}: use auto, on or off")
        from gpulab.parallel.allreduce import ALGORITHMS

        if self.allreduce not in ALGORITHMS:
            raise UserError(f"--allreduce {self.allreduce}: choose one of {', '.join(ALGORITHMS)}")
        from gpulab.parallel.distributed import SYNCS

        if self.sync not in SYNCS:
            raise UserError(f"--sync {self.sync}: choose {' or '.join(SYNCS)}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise UserError(f"--backend {self.backend}: choose auto, gloo or nccl")
        if not (self.timeout > 0 and math.isfinite(self.timeout)):
            raise UserError(f"--timeout {self.timeout}: give the collective timeout in seconds, > 0")
        if self.accumulate < 1:
            raise UserError(f"--accumulate {self.accumulate}: use 1 (no accumulation) or more micro-batches per step")

    @property
    def recipe_spec(self) -> Recipe:
        return RECIPES[self.recipe]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:  # a hand-edited config.json with a value of the wrong type
            raise UserError(f"config.json has a value of the wrong type ({e}); restore the original file") from None
