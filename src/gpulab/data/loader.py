"""Feeding batches to the device.

`DeviceLoader` is the fast path: the whole dataset sits on the training device as one
uint8 tensor (Fashion-MNIST's 60k images are 47 MB), each epoch is one device-side
gather through a permutation, and batches are sliced, converted and normalized on the
device. No per-sample Python, no worker processes, no host->device copy per step.

`HostLoader` wraps any `torch.utils.data.DataLoader` (or iterable of (X, y) batches) so a
user's own data goes through the same trainer; it copies each batch with
`non_blocking=True`, which only overlaps with compute when the loader pins memory.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import Dataset

from gpulab.data.fashion_mnist import Split
from gpulab.data.sampling import GlobalBatches
from gpulab.errors import UserError

# Fashion-MNIST training-set statistics of pixel/255, measured once on the full train split.
FASHION_MEAN = 0.2860
FASHION_STD = 0.3530


class DeviceLoader:
    """Minibatches of a `Split` that lives entirely on `device`.

    Which samples form each batch (and, under torchrun, which part of it this rank takes) is
    decided by `GlobalBatches`: shuffled from (seed, epoch), the same on every device and rank,
    so a resumed run sees exactly the batches an uninterrupted one would.
    """

    def __init__(
        self,
        split: Split,
        batch_size: int,
        device: torch.device,
        *,
        shuffle: bool = False,
        seed: int = 0,
        normalize: bool = True,
        channels_last: bool = False,
        drop_last: bool = False,
        rank: int = 0,
        world_size: int = 1,
    ):
        self.images = split.images.to(device)  # uint8: 4x less memory than float32
        self.labels = split.labels.to(device)
        self.batches = GlobalBatches(
            len(split), batch_size, shuffle=shuffle, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last
        )
        self.batch_size = batch_size
        self.device = device
        self.channels_last = channels_last
        mean, std = (FASHION_MEAN, FASHION_STD) if normalize else (0.0, 1.0)
        # x_norm = (x/255 - mean)/std = x * scale + shift, one fused multiply-add per batch
        self.scale = 1.0 / (255.0 * std)
        self.shift = -mean / std

    def __len__(self) -> int:
        return len(self.batches)

    def set_epoch(self, epoch: int) -> None:
        self.batches.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.batches.order().to(self.device)  # one copy per epoch, then slices on the device
        for lo, hi in self.batches.spans():
            if hi > lo:
                idx = order[lo:hi]
                yield self._batch(self.images[idx], self.labels[idx])

    def _batch(self, images_u8: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        X = images_u8.float().mul_(self.scale).add_(self.shift)
        if self.channels_last:
            X = X.contiguous(memory_format=torch.channels_last)
        return X, labels


class HostLoader:
    """Batches from any DataLoader-like iterable, copied to `device` as they are used."""

    def __init__(self, batches: Iterable, device: torch.device, channels_last: bool = False):
        self.batches = batches
        self.device = device
        self.channels_last = channels_last

    def __len__(self) -> int:
        return len(self.batches)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        for sampler in (getattr(self.batches, "batch_sampler", None), getattr(self.batches, "sampler", None)):
            if hasattr(sampler, "set_epoch"):
                sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        memory_format = torch.channels_last if self.channels_last else torch.preserve_format
        for batch in self.batches:
            X, y = input_and_labels(batch)
            X = X.to(self.device, non_blocking=True, memory_format=memory_format)
            yield X, y.to(self.device, non_blocking=True)


def input_and_labels(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of the caller's data as the (inputs, labels) pair gpulab trains on, or one line
    saying what it is instead (a dict of fields, a triple, inputs alone)."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return batch[0], batch[1]
    raise not_a_pair(batch)


def not_a_pair(value) -> UserError:
    """The one line for a sample or batch that is no (inputs, labels) pair, saying what it is."""
    what = (f"a dict with keys {', '.join(map(str, list(value)[:5]))}" if isinstance(value, dict) else
            f"a {type(value).__name__} of {len(value)}" if isinstance(value, (tuple, list)) else f"a {type(value).__name__}")
    return UserError(f"train_data/test_data must give (inputs, labels) pairs of tensors; one was {what}: return "
                     "(x, y) from the Dataset's __getitem__, or pass a DataLoader whose collate_fn makes that pair")


class ImageDataset(Dataset):
    """A per-sample view of a `Split` for `torch.utils.data.DataLoader` (pixels in [0, 1]).

    This is the classic input pipeline (the textbook's `ToTensor` + DataLoader); gpulab's
    trainer prefers `DeviceLoader`, and the benchmarks compare the two.
    """

    def __init__(self, split: Split):
        self.split = split

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.split.images[i].float() / 255.0, int(self.split.labels[i])
