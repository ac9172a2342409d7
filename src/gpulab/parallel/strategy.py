"""What a training step needs from a way of running it in parallel: one small interface.

gpulab.train.step's Trainer runs one train_step for all of them; a strategy holds the model
copies and their optimizers, and says how a batch is split and how gradients meet:

    DataParallel   one process, k devices (cpu*K, cuda:0,cuda:1, ...): replicas, the batch
                   split over them, gpulab's buckets all-reduced in the process after backward
    Distributed    one device per torchrun rank: gpulab's bucketed sync across ranks, overlapped
                   with backward (--sync gpulab)
    DDPSync        one device per torchrun rank: PyTorch's DistributedDataParallel, the reference
                   gpulab's sync must match (--sync ddp)
    Sharded        one device per torchrun rank, the model sharded over the ranks (--shard fsdp:
                   torch's FSDP2)
(the last three share their rank's state and collectives: parallel/ranks.py).

Coordination between processes (who is the main one, who prints and writes, agreeing on
errors) is the `World`'s job (`gpulab.parallel.world`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

import torch
from torch import nn

Shard = tuple[torch.Tensor, torch.Tensor]
"""(inputs, labels) of one replica's part of a batch, on its device."""


class Strategy(Protocol):
    devices: list[torch.device]
    """The devices this process computes on; metrics accumulate on the first."""
    num_replicas: int
    """Model copies in the whole job: k devices in one process, or one per rank."""
    replicas: list[nn.Module]
    """This process's copies of the model (identical after every step)."""
    optimizers: list[torch.optim.Optimizer]
    """One per replica of this process; they step together."""
    loss_scale: int
    """What each part's weighted loss is multiplied by before backward: the world size where the
    exchange averages gradients over ranks (DDP, FSDP), 1 where it sums them (gpulab's)."""
    description: str
    """How gradients are exchanged, for the banner ("allreduce ring", "sync gpulab over gloo")."""
    sharded_checkpoint: bool
    """False: state_dict() is whole on every process and rank 0 writes it; True (Sharded): every
    rank writes its shard (save_shards / load_shards)."""

    def global_batch(self, local: int) -> int:
        """The samples of the whole step (every process) when this process holds `local` of them."""
        ...

    def split(self, X: torch.Tensor, y: torch.Tensor) -> list[Shard]:
        """This process's part of a batch as one shard per replica, each on its device."""
        ...

    def each(self, fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple], shards: list[Shard]) -> list[tuple]:
        """fn(model, X, y) for every replica and its shard: the model as training calls it."""
        ...

    def zero_grad(self) -> None: ...

    def exchanging(self, last: bool) -> AbstractContextManager:
        """Around one micro-batch's backward; `last`: the step's last, during which gradients
        are exchanged (the others accumulate locally: DDP's no_sync)."""
        ...

    def finish_exchange(self) -> AbstractContextManager:
        """After the last backward: the exchange completed. Returns the context the optimizers
        step in (parameters that got no gradient anywhere hidden from them, as plain PyTorch
        skips a None .grad)."""
        ...

    def collectives(self) -> AbstractContextManager:
        """Around collectives: one that failed because of another rank raises PeerLost."""
        ...

    def sum_over_processes(self, t: torch.Tensor) -> None:
        """`t` summed in place over every process of the job (collective)."""
        ...

    def train(self, mode: bool = True) -> None: ...

    def sync_buffers(self) -> None:
        """BatchNorm's running statistics made equal over the replicas (averaged), before they
        are used or saved."""
        ...

    def state_dict(self) -> dict:
        """Model and optimizer state, identical on every process (collective: call it on all)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...
