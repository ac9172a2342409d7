"""What the torchrun strategies share: one device per rank, a model on it that starts from rank
0's parameters, and the collectives that read the job's metrics and keep BatchNorm's running
statistics in step.

    RankStrategy   the common state and steps of Distributed (gpulab's bucketed sync), DDPSync
                   (DDP) and Sharded (FSDP2); each adds how gradients are exchanged (exchanging,
                   and where the wrapper's exchange is not done with backward, zero_grad and
                   finish_exchange)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from torch import nn

from gpulab.parallel.strategy import Shard
from gpulab.parallel.world import World

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def broadcast_from_main(module: nn.Module, world: World) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    import torch.distributed as dist

    with torch.no_grad(), world.collectives():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=0, group=world.group)


@torch.no_grad()
def average_buffers(module: nn.Module, world: World) -> None:
    """The floating-point buffers (BatchNorm's running statistics) averaged over ranks (collective)."""
    import torch.distributed as dist

    with world.collectives():
        for b in module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b, group=world.group)
                b.div_(world.world_size)


class RankStrategy:
    """One torchrun rank's device, model and part of every global batch; the subclass adds the
    gradient exchange, and its own state where it differs."""

    sharded_checkpoint = False  # state_dict() is whole on every process; rank 0 writes it
    loss_scale = 1

    def __init__(self, module: nn.Module, world: World, device: torch.device, batch_size: int):
        """`batch_size`: the global batch (all ranks together) of every training step."""
        self.world = world
        self.devices = [device]
        self.num_replicas = world.world_size
        self.batch_size = batch_size
        self.buffers_stale = True  # BatchNorm's running statistics drift apart per rank
        self.module = module.to(device)
        broadcast_from_main(self.module, world)
        self.module.train(True)  # set once here (evaluation restores it), not walked every step
        self.replicas = [self.module]  # this process's copies of the model (DataParallel has k)
        self.model: nn.Module = self.module  # what training calls: the subclass's wrapper, if any
        self.optimizers: list[torch.optim.Optimizer] = []  # the subclass's, once its model is wrapped

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimizers[0]

    def global_batch(self, local: int) -> int:
        return self.batch_size

    def zero_grad(self) -> None:
        self.buffers_stale = True  # a training step: evaluate / state_dict average them once again
        self.optimizer.zero_grad(set_to_none=True)

    def finish_exchange(self):
        return nullcontext()  # a wrapper's own exchange (DDP's, FSDP's) is done when its backward returns

    def split(self, X: torch.Tensor, y: torch.Tensor) -> list[Shard]:
        return [(X, y)]  # this rank's part is already on its device

    def each(self, fn, shards: list[Shard]) -> list[tuple]:
        (X, y), = shards
        return [fn(self.model, X, y)]

    def collectives(self):
        return self.world.collectives()

    def sum_over_processes(self, t: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.all_reduce(t, group=self.world.group)

    def train(self, mode: bool = True) -> None:
        self.module.train(mode)

    def sync_buffers(self) -> None:
        """Average BatchNorm running statistics over ranks. Collective: every rank has made the
        same steps, so every rank agrees whether there is work to do."""
        if self.buffers_stale:
            self.buffers_stale = False
            average_buffers(self.module, self.world)

    def state_dict(self) -> dict:
        self.sync_buffers()
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
