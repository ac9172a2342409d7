"""Which samples each step uses: one rule for every loader, every device and every rank.

An epoch's order is a permutation of 0..N-1 drawn from (seed, epoch) on the CPU, so it is the
same on every device type, every rank and every resumed run. The order is cut into *global*
batches of `batch_size`; with `world_size` ranks, rank r takes part r of each global batch
(`torch.tensor_split`: parts differ by at most one sample). K ranks with global batch B thus
compute, together, exactly the batches one process would.

Training drops the short remainder (`drop_last`): every step is a full batch of B on every
rank, so all ranks run the same number of steps (no collective can wait for a rank that has
finished) and each rank knows the global batch size without asking. The N mod B samples left
out differ from epoch to epoch because the order is reshuffled. Evaluation keeps every sample:
a rank whose part of the last batch is empty skips it (evaluation has no collective per batch).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gpulab.errors import UserError


class GlobalBatches:
    """This rank's sample indices, step by step. Usable as a DataLoader `batch_sampler`."""

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise UserError(f"batch size {batch_size}: must be >= 1")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} of a world of {world_size}: a rank runs from 0 to world_size - 1")
        if drop_last and num_samples < batch_size:
            raise UserError(
                f"the training set has {num_samples} samples, fewer than one batch of {batch_size}: "
                f"use --batch-size {num_samples} or less"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0

    def __len__(self) -> int:
        n, b = self.num_samples, self.batch_size
        return n // b if self.drop_last else -(-n // b)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def order(self) -> torch.Tensor:
        """The epoch's sample order (int64, on the CPU), identical on every rank."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=g)

    def spans(self) -> Iterator[tuple[int, int]]:
        """(start, stop) into `order()` of this rank's part of each global batch."""
        for i in range(len(self)):
            start = i * self.batch_size
            size = min(self.batch_size, self.num_samples - start)
            # tensor_split's rule: the first (size % world) parts get one extra sample.
            base, extra = divmod(size, self.world_size)
            lo = start + self.rank * base + min(self.rank, extra)
            yield lo, lo + base + (self.rank < extra)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.order()
        for lo, hi in self.spans():
            if hi > lo:
                yield order[lo:hi].tolist()
