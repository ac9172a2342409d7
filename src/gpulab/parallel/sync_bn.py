"""BatchNorm whose statistics span every replica: of one process, or of every torchrun rank.

Per-device BatchNorm (the default, as the chapter suggests) normalizes each shard with its own
mean and variance: no communication, but the statistics come from batch/k samples, so a
k-device run is not the same computation as a 1-device run, and tiny shards get noisy.

`SyncBatchNorm2d` gathers each replica's per-channel sum, sum of squares and count, so every
replica normalizes with the statistics of the whole minibatch: the k-device forward equals
the 1-device forward. The price is a rendezvous per BN layer per step, which is why the
replicas' forward passes run in threads (`DataParallel(sync_bn=True)`). The gathered
statistics are differentiable copies, so one joint backward over all replicas' losses sends
each replica its share of the gradient through the shared statistics.

Across torchrun ranks (`RankExchange`) the sum is torch's functional all_reduce, which is
differentiable too: its backward all-reduces the statistics' gradient, so every rank gets its
share exactly as the joint backward gives it in one process.
"""

from __future__ import annotations

import threading

import torch
from torch import nn


class StatsExchange:
    """A rendezvous where k replicas of one layer swap tensors."""

    def __init__(self, num_replicas: int, timeout_s: float = 300.0):
        self.slots: list[torch.Tensor | None] = [None] * num_replicas
        self.barrier = threading.Barrier(num_replicas, timeout=timeout_s)

    def all_gather(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = t
        self.barrier.wait()
        gathered = [s.to(t.device) for s in self.slots]  # type: ignore[union-attr]
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return gathered

    def all_sum(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self.all_gather(rank, t)).sum(0)

    def abort(self) -> None:
        self.barrier.abort()


class RankExchange:
    """The same sum across the ranks of a process group (one replica per rank)."""

    def __init__(self, group):
        self.group = group

    def all_sum(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_reduce(t, "sum", self.group))


class SyncBatchNorm2d(nn.BatchNorm2d):
    exchange: StatsExchange | RankExchange | None = None
    rank: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.exchange is None:
            return super().forward(x)
        # Statistics in the buffers' precision (float32 even under bf16 autocast), as BatchNorm2d does.
        out_dtype, x = x.dtype, x.to(self.running_mean.dtype)
        dims = (0, 2, 3)
        c = x.shape[1]
        # Two rounds (mean, then centred squares) rather than one round of sum and sum of
        # squares: E[x^2] - mean^2 cancels badly in float32 and breaks parity with BatchNorm2d.
        count = torch.full((1,), x.numel() / c, device=x.device, dtype=x.dtype)
        total = self.exchange.all_sum(self.rank, torch.cat([x.sum(dims), count]))
        n = total[-1]
        mean = total[:c] / n
        centred = x - mean.view(1, c, 1, 1)
        squares = self.exchange.all_sum(self.rank, (centred * centred).sum(dims))
        var = squares / n
        with torch.no_grad():
            m = self.momentum if self.momentum is not None else 0.1
            self.running_mean.lerp_(mean.detach(), m)
            self.running_var.lerp_(var.detach() * n / (n - 1).clamp_min(1), m)
            self.num_batches_tracked += 1
        shape = (1, c, 1, 1)
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(out_dtype)


def convert_to_sync(replicas: list[nn.Module]) -> list[nn.Module]:
    """Swap every BatchNorm2d of each replica for a SyncBatchNorm2d sharing one exchange per layer."""
    k = len(replicas)
    per_replica = [[m for m in r.modules() if isinstance(m, nn.BatchNorm2d)] for r in replicas]
    for layer in zip(*per_replica):
        exchange = StatsExchange(k)
        for rank, bn in enumerate(layer):
            bn.__class__ = SyncBatchNorm2d  # same parameters and buffers, new forward
            bn.exchange = exchange
            bn.rank = rank
    return replicas


def convert_across_ranks(module: nn.Module, group) -> nn.Module:
    """Swap every BatchNorm2d of this rank's model for a SyncBatchNorm2d summing over `group`."""
    exchange = RankExchange(group)
    for bn in module.modules():
        if isinstance(bn, nn.BatchNorm2d):
            bn.__class__ = SyncBatchNorm2d
            bn.exchange = exchange
    return module


def exchanges(replicas: list[nn.Module]) -> list[StatsExchange]:
    return [m.exchange for m in replicas[0].modules() if isinstance(m, SyncBatchNorm2d) and isinstance(m.exchange, StatsExchange)]
