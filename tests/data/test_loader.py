"""DeviceLoader (dataset resident on the device) and HostLoader (any DataLoader)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from gpulab.data import DeviceLoader, HostLoader, ImageDataset, Split, fashion_mnist
from gpulab.data.loader import FASHION_MEAN, FASHION_STD
from gpulab.errors import UserError

CPU = torch.device("cpu")


def split(n: int = 103, seed: int = 0) -> Split:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    # label i is i % 10, and pixel [0, 0] encodes the sample index: batches can be traced back
    images[:, 0, 0, 0] = torch.arange(n, dtype=torch.uint8)
    return Split(images=images, labels=torch.arange(n) % 10)


def sample_ids(loader: DeviceLoader) -> list[int]:
    """The sample indices the loader yields, in order (pixel [0, 0] before normalization)."""
    ids = []
    for X, y in loader:
        raw = ((X[:, 0, 0, 0] - loader.shift) / loader.scale).round().long()
        assert torch.equal(raw % 10, y)
        ids += raw.tolist()
    return ids


@pytest.mark.parametrize("batch_size", [10, 16, 103, 500])
def test_every_sample_exactly_once_per_epoch(batch_size):
    data = split(103)
    loader = DeviceLoader(data, batch_size, CPU, shuffle=True, seed=3)
    batches = list(loader)
    assert len(batches) == len(loader) == -(-103 // batch_size)
    assert all(len(y) == batch_size for _, y in batches[:-1])
    assert sum(len(y) for _, y in batches) == 103
    for epoch in range(3):
        loader.set_epoch(epoch)
        assert sorted(sample_ids(loader)) == list(range(103))


def test_drop_last_drops_the_partial_batch():
    loader = DeviceLoader(split(103), 10, CPU, shuffle=True, drop_last=True)
    assert len(loader) == 10
    ids = sample_ids(loader)
    assert len(ids) == 100 and len(set(ids)) == 100


def test_no_shuffle_keeps_file_order():
    loader = DeviceLoader(split(25), 10, CPU)
    assert sample_ids(loader) == list(range(25))
    loader.set_epoch(5)
    assert sample_ids(loader) == list(range(25))


def test_order_changes_between_epochs_and_repeats_for_the_same_seed_and_epoch():
    data = split(103)
    a = DeviceLoader(data, 16, CPU, shuffle=True, seed=1)
    b = DeviceLoader(data, 16, CPU, shuffle=True, seed=1)
    a.set_epoch(0)
    epoch0 = sample_ids(a)
    a.set_epoch(1)
    epoch1 = sample_ids(a)
    assert epoch0 != epoch1
    assert epoch0 != list(range(103))
    b.set_epoch(1)
    assert sample_ids(b) == epoch1  # another loader, same (seed, epoch): same order
    a.set_epoch(0)
    assert sample_ids(a) == epoch0  # and the same loader going back to epoch 0
    other_seed = DeviceLoader(data, 16, CPU, shuffle=True, seed=2)
    assert sample_ids(other_seed) != epoch0


def test_order_does_not_depend_on_the_global_rng():
    loader = DeviceLoader(split(50), 8, CPU, shuffle=True, seed=0)
    torch.manual_seed(123)
    first = loader.batches.order().tolist()
    torch.manual_seed(456)
    torch.rand(10)
    assert loader.batches.order().tolist() == first


def test_normalization_values():
    data = split(20)
    X, y = next(iter(DeviceLoader(data, 20, CPU)))
    assert X.dtype == torch.float32 and X.shape == (20, 1, 28, 28)
    expected = (data.images.double() / 255 - FASHION_MEAN) / FASHION_STD
    torch.testing.assert_close(X.double(), expected, rtol=0, atol=1e-5)
    assert torch.equal(y, data.labels)
    # and the stored images stay uint8 (4x smaller than float32)
    assert DeviceLoader(data, 20, CPU).images.dtype == torch.uint8


def test_no_normalization_is_pixels_in_0_1():
    data = split(20)
    X, _ = next(iter(DeviceLoader(data, 20, CPU, normalize=False)))
    torch.testing.assert_close(X.double(), data.images.double() / 255, rtol=0, atol=1e-6)
    assert X.min() >= 0 and X.max() <= 1


def test_normalization_constants_match_fashion_mnist_if_present():
    try:
        train, _ = fashion_mnist.load()
    except UserError:
        pytest.skip("real Fashion-MNIST not installed")
    if len(train) != 60_000:
        pytest.skip("the dataset found is not the real Fashion-MNIST")
    pixels = train.images.double() / 255
    assert abs(pixels.mean().item() - FASHION_MEAN) < 5e-4
    assert abs(pixels.std().item() - FASHION_STD) < 5e-4


@pytest.mark.parametrize("channels_last", [False, True])
def test_channels_last_output_format(channels_last):
    # three channels, so the two layouts have different strides
    images = torch.randint(0, 256, (8, 3, 28, 28), dtype=torch.uint8)
    data = Split(images=images, labels=torch.zeros(8, dtype=torch.long))
    X, _ = next(iter(DeviceLoader(data, 4, CPU, channels_last=channels_last)))
    assert X.shape == (4, 3, 28, 28)
    assert X.is_contiguous(memory_format=torch.channels_last) == channels_last
    assert X.is_contiguous() == (not channels_last)
    assert X.stride() == ((2352, 1, 84, 3) if channels_last else (2352, 784, 28, 1))


def test_channels_last_one_channel():
    X, _ = next(iter(DeviceLoader(split(8), 4, CPU, channels_last=True)))
    assert X.shape == (4, 1, 28, 28)
    assert X.is_contiguous(memory_format=torch.channels_last)


def test_host_loader_gives_the_same_samples_as_device_loader():
    data = split(45)
    device = DeviceLoader(data, 16, CPU, normalize=False)
    host = HostLoader(DataLoader(ImageDataset(data), batch_size=16, shuffle=False), CPU)
    assert len(host) == len(device) == 3
    pairs = list(zip(host, device))
    assert len(pairs) == 3
    for (Xh, yh), (Xd, yd) in pairs:
        assert Xh.device == CPU and Xh.dtype == torch.float32
        assert torch.equal(yh, yd)
        torch.testing.assert_close(Xh, Xd, rtol=0, atol=1e-6)


def test_host_loader_channels_last():
    images = torch.randint(0, 256, (8, 3, 28, 28), dtype=torch.uint8)
    data = Split(images=images, labels=torch.zeros(8, dtype=torch.long))
    X, _ = next(iter(HostLoader(DataLoader(ImageDataset(data), batch_size=4), CPU, channels_last=True)))
    assert X.stride() == (2352, 1, 84, 3)
    X, _ = next(iter(HostLoader(DataLoader(ImageDataset(data), batch_size=4), CPU)))
    assert X.stride() == (2352, 784, 28, 1)


def test_host_loader_shuffled_covers_every_sample_once():
    data = split(45)
    host = HostLoader(DataLoader(ImageDataset(data), batch_size=16, shuffle=True), CPU)
    host.set_epoch(1)  # a plain RandomSampler has no set_epoch: must be a no-op, not an error
    ids = [int(i) for X, _ in host for i in (X[:, 0, 0, 0] * 255).round().long()]
    assert sorted(ids) == list(range(45))


@pytest.mark.parametrize("rank, world_size", [(5, 3), (-1, 2), (2, 2)])
def test_a_rank_outside_its_world_is_refused(rank, world_size):
    """GlobalBatches(10, 4, rank=5, world_size=3) gave one sample of the next batch, then none."""
    from gpulab.data import GlobalBatches

    with pytest.raises(ValueError, match=f"rank {rank} of a world of {world_size}"):
        GlobalBatches(10, 4, rank=rank, world_size=world_size)
