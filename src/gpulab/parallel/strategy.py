"""What the training loop needs from a way of running a step: one small interface.

Two strategies implement it:

    DataParallel   one process, k devices (cpu*K, cuda:0,cuda:1, ...): replicate, split,
                   in-process allreduce, k optimizers stepping together
    Distributed    one device per torchrun rank: gpulab's bucketed gradient sync overlapped
                   with backward (--sync gpulab), or PyTorch's DDP as the reference (--sync ddp)

Both see the same global batches (`gpulab.data.GlobalBatches`) and compute the same update as
one model stepped by plain PyTorch on those batches. Coordination between processes (who is
the main one, who prints and writes, agreeing on errors) is the `World`'s job
(`gpulab.parallel.world`); every strategy carries the world it runs in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from gpulab.parallel.meter import Meter
from gpulab.parallel.world import World

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy(Protocol):
    world: World
    devices: list[torch.device]
    """The devices this process computes on; metrics accumulate on the first."""
    autocast: torch.dtype | None
    num_replicas: int
    """Model copies in the whole job: k devices in one process, or one per rank."""
    description: str
    """How gradients are exchanged, for the banner ("allreduce ring", "sync gpulab over gloo")."""

    def set_lr(self, lr: float) -> None: ...

    def train_step(self, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, meter: Meter | None = None) -> torch.Tensor:
        """One synchronized optimizer step on this process's part of a global batch; returns
        this process's share of the batch's mean loss, on the device. Never reads the device."""
        ...

    def reduce(self, meter: Meter) -> dict[str, float]:
        """The meter's totals over every replica of the job, read on the host (collective)."""
        ...

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn | None = None) -> dict:
        """Loss and accuracy over every sample of `batches` of every process, each counted once (collective)."""
        ...

    def state_dict(self) -> dict:
        """Model and optimizer state, identical on every process (collective: call it on all)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...
