"""A user's own data: a Dataset or DataLoader of (input, label), batched by gpulab's rule
(GlobalBatches) on the host and copied batch by batch to the device."""

from __future__ import annotations

import torch

from gpulab.data.fashion_mnist import Split
from gpulab.data.loader import HostLoader, not_a_pair
from gpulab.data.sampling import GlobalBatches
from gpulab.errors import UserError


def user_loader(source, batch_size: int, device: torch.device, train: bool, seed: int, rank: int, world_size: int,
                channels_last: bool) -> HostLoader:
    """A user's own Dataset or DataLoader, batched by gpulab's rule and copied batch by batch to `device`.

    A Dataset is batched with GlobalBatches (the same batches as the built-in data would get).
    A DataLoader is used as it is in one process; under torchrun its dataset is re-batched with
    GlobalBatches (global batch = its batch_size), keeping its collate_fn, workers and pinning,
    so that every rank takes its own part of the same batches."""
    if not hasattr(source, "__len__"):
        raise UserError("train_data/test_data must have a length (a map-style Dataset or a DataLoader over one)")
    DataLoader = torch.utils.data.DataLoader
    if isinstance(source, DataLoader) and world_size == 1:
        return HostLoader(source, device, channels_last=channels_last)
    dataset, options = source, dict(pin_memory=device.type == "cuda")
    if isinstance(source, DataLoader):
        dataset = source.dataset
        options = dict(collate_fn=source.collate_fn, num_workers=source.num_workers, pin_memory=source.pin_memory)
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise UserError("gpulab cannot split an IterableDataset between ranks or batches: pass a map-style Dataset")
    batches = GlobalBatches(len(dataset), batch_size, shuffle=train, seed=seed, rank=rank, world_size=world_size,
                            drop_last=train)
    return HostLoader(DataLoader(dataset, batch_sampler=batches, **options), device, channels_last=channels_last)


def check_pairs(source) -> None:
    """Before anything is written: a Dataset's first sample (one a DataLoader collates as it is) is
    an (input, label) pair, else one line (HostLoader says the same of a batch)."""
    loader = isinstance(source, torch.utils.data.DataLoader)
    dataset = source.dataset if loader else source
    if (loader and source.collate_fn is not torch.utils.data.default_collate) or isinstance(
            dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return
    sample = dataset[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise not_a_pair(sample)


def sample_shape(source) -> tuple[int, ...] | None:
    """One input's shape (no batch dimension), from the first sample; None when it cannot be read
    without consuming the user's iterator."""
    if isinstance(source, Split):
        return tuple(source.images.shape[1:])
    dataset = source if isinstance(source, torch.utils.data.Dataset) else getattr(source, "dataset", None)
    if dataset is None or isinstance(dataset, torch.utils.data.IterableDataset) or len(dataset) == 0:
        return None
    sample = dataset[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) >= 1):  # a dict, say, that a collate_fn pairs up
        return None
    return tuple(torch.as_tensor(sample[0]).shape)
