"""BatchNorm whose statistics span every replica: of one process, or of every torchrun rank.

Per-device BatchNorm (the default, as the chapter suggests) normalizes each shard with its own
mean and variance: no communication, but the statistics come from batch/k samples, so a
k-device run is not the same computation as a 1-device run, and tiny shards get noisy.

`SyncBatchNorm` (BatchNorm1d, 2d and 3d alike) gathers each replica's per-channel sum, sum of squares and count, so every
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

from gpulab.errors import UserError


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


class SyncBatchNorm(nn.modules.batchnorm._BatchNorm):
    """The forward of every synchronized BatchNorm, over any input rank: (N, C), (N, C, L),
    (N, C, H, W), (N, C, D, H, W). A layer becomes one by a class swap (the same parameters and
    buffers): SYNCED names the class each of torch's BatchNorms becomes."""

    exchange: StatsExchange | RankExchange | None = None
    rank: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.exchange is None:
            return super().forward(x)
        self._check_input_dim(x)
        # Statistics in the buffers' precision (float32 even under bf16 autocast), as BatchNorm does.
        stats_dtype = self.running_mean.dtype if self.running_mean is not None else torch.promote_types(x.dtype, torch.float32)
        out_dtype, x = x.dtype, x.to(stats_dtype)
        dims = (0, *range(2, x.dim()))
        c = x.shape[1]
        shape = (1, c) + (1,) * (x.dim() - 2)
        # Two rounds (mean, then centred squares) rather than one round of sum and sum of
        # squares: E[x^2] - mean^2 cancels badly in float32 and breaks parity with BatchNorm.
        count = torch.full((1,), x.numel() / c, device=x.device, dtype=x.dtype)
        total = self.exchange.all_sum(self.rank, torch.cat([x.sum(dims), count]))
        n = total[-1]
        mean = total[:c] / n
        centred = x - mean.view(shape)
        squares = self.exchange.all_sum(self.rank, (centred * centred).sum(dims))
        var = squares / n
        if self.track_running_stats:
            self._update_running_stats(mean.detach(), var.detach() * n / (n - 1).clamp_min(1))
        y = centred * torch.rsqrt(var.view(shape) + self.eps)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y.to(out_dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """As BatchNorm updates them: by `momentum`, or with momentum=None a cumulative average."""
        self.num_batches_tracked += 1
        factor = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
        self.running_mean.lerp_(mean, factor)
        self.running_var.lerp_(unbiased_var, factor)


class SyncBatchNorm1d(SyncBatchNorm, nn.BatchNorm1d):
    pass


class SyncBatchNorm2d(SyncBatchNorm, nn.BatchNorm2d):
    pass


class SyncBatchNorm3d(SyncBatchNorm, nn.BatchNorm3d):
    pass


SYNCED = {nn.BatchNorm1d: SyncBatchNorm1d, nn.BatchNorm2d: SyncBatchNorm2d, nn.BatchNorm3d: SyncBatchNorm3d}


def batch_norms(module: nn.Module) -> list[nn.Module]:
    """The module's BatchNorm layers, each of a kind SYNCED knows; any other kind (a subclass with
    a forward of its own, torch's SyncBatchNorm) is one line: its swap would drop its own forward."""
    found = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    other = next((m for m in found if type(m) not in SYNCED and not isinstance(m, SyncBatchNorm)), None)
    if other is not None:
        raise UserError(f"--sync-bn: {type(other).__name__} is a BatchNorm of its own kind, which gpulab does not "
                        "synchronize (it does nn.BatchNorm1d, 2d and 3d): use those, or drop --sync-bn")
    return found


def _synced(bn: nn.Module, exchange, rank: int = 0) -> None:
    bn.__class__ = SYNCED.get(type(bn), type(bn))  # same parameters and buffers, new forward
    bn.exchange = exchange
    bn.rank = rank


def convert_to_sync(replicas: list[nn.Module]) -> list[nn.Module]:
    """Swap every BatchNorm of each replica for its synchronized kind, sharing one exchange per layer."""
    k = len(replicas)
    for layer in zip(*[batch_norms(r) for r in replicas]):
        exchange = StatsExchange(k)
        for rank, bn in enumerate(layer):
            _synced(bn, exchange, rank)
    return replicas


def convert_across_ranks(module: nn.Module, group) -> nn.Module:
    """Swap every BatchNorm of this rank's model for its synchronized kind, summing over `group`."""
    exchange = RankExchange(group)
    for bn in batch_norms(module):
        _synced(bn, exchange)
    return module


def exchanges(replicas: list[nn.Module]) -> list[StatsExchange]:
    return [m.exchange for m in replicas[0].modules() if isinstance(m, SyncBatchNorm) and isinstance(m.exchange, StatsExchange)]
