"""What the two torchrun strategies share: one device per rank, a model on it that starts from
rank 0's parameters, and the collectives that read the job's metrics and keep BatchNorm's running
statistics in step.

    RankStrategy   the common state and steps of Distributed (replicated: gpulab's bucketed
                   sync or DDP) and Sharded (FSDP2); each adds how gradients are exchanged
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from gpulab.parallel.meter import Meter, summarize
from gpulab.parallel.phases import PhaseTimer
from gpulab.parallel.strategy import ShardStep, set_lr
from gpulab.parallel.world import World

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def broadcast_from_main(module: nn.Module, world: World) -> None:
    """Every rank starts from rank 0's parameters and buffers."""
    import torch.distributed as dist

    with torch.no_grad(), world.collectives():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=0, group=world.group)


def reduce_over_ranks(meter: Meter, world: World) -> dict[str, float]:
    """Every rank's loss sum, correct count and sample count, summed in one collective."""
    import torch.distributed as dist

    totals = torch.cat([meter.totals, meter.totals.new_tensor([meter.count])])
    with world.collectives():
        dist.all_reduce(totals, group=world.group)
    return summarize(*totals.tolist())


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
    """One torchrun rank's device, model and shard of every global batch; the subclass adds the
    gradient exchange (train_step), evaluation and state."""

    def __init__(self, module: nn.Module, world: World, device: torch.device, batch_size: int,
                 accumulate: int, timer: PhaseTimer | None, autocast: torch.dtype | None, compile: str):
        """`batch_size`: the global batch (all ranks together) of every training step; `compile`:
        how each micro-batch's forward and loss run (ShardStep)."""
        self.world = world
        self.devices = [device]
        self.num_replicas = world.world_size
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.autocast = autocast
        self.buffers_stale = True  # BatchNorm's running statistics drift apart per rank
        self.timer = timer or PhaseTimer([device], enabled=False)
        self.module = module.to(device)
        broadcast_from_main(self.module, world)
        self.replicas = [self.module]  # this process's copies of the model (DataParallel has k)
        self.optimizer: torch.optim.Optimizer | None = None  # the subclass's, once its model is wrapped
        self.shard_step = ShardStep(compile)

    def set_lr(self, lr: float) -> None:
        set_lr([self.optimizer], lr)

    def reduce(self, meter: Meter) -> dict[str, float]:
        return reduce_over_ranks(meter, self.world)

    def sync_buffers(self) -> None:
        """Average BatchNorm running statistics over ranks. Collective: every rank has made the
        same steps, so every rank agrees whether there is work to do."""
        if self.buffers_stale:
            self.buffers_stale = False
            average_buffers(self.module, self.world)
