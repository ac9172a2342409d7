"""Fashion-MNIST decoded once: later loads read gpulab's cache, and never a stale, damaged or
foreign entry (the answer is always the source files')."""

from pathlib import Path

import numpy as np
import pytest
import torch

from gpulab.data import decoded, fashion_mnist
from gpulab.data.idx import write_idx
from gpulab.errors import UserError


def write_set(folder: Path, seed: int, n_train: int = 12, n_test: int = 5) -> Path:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for part, n in (("train", n_train), ("t10k", n_test)):
        write_idx(folder / f"{part}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{part}-labels-idx1-ubyte.gz", rng.integers(0, 10, (n,), dtype=np.uint8))
    return folder


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "gpulab" / "fashion-mnist-decoded"


def same(a, b) -> bool:
    return all(torch.equal(x.images, y.images) and torch.equal(x.labels, y.labels) for x, y in zip(a, b))


def decoding_forbidden(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("decoded the IDX files again")

    monkeypatch.setattr(fashion_mnist, "read_idx", refuse)


def test_a_second_load_reads_the_decoded_arrays_not_the_files(tmp_path, cache, monkeypatch):
    data = write_set(tmp_path / "data", seed=0)
    first = fashion_mnist.load(data)
    assert len(list(cache.iterdir())) == 1
    decoding_forbidden(monkeypatch)
    second = fashion_mnist.load(data)
    assert same(first, second) and second[0].images.shape == (12, 1, 28, 28) and second[1].labels.dtype == torch.int64


def test_a_changed_source_file_is_decoded_again(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    fashion_mnist.load(data)
    write_set(data, seed=1)  # the same names, other contents
    assert same(fashion_mnist.load(data), fashion_mnist.load(write_set(tmp_path / "fresh", seed=1)))


def test_a_damaged_entry_is_decoded_again(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    first = fashion_mnist.load(data)
    entry = next(cache.iterdir())
    (entry / "train_images.npy").write_bytes(b"not an array")
    assert same(fashion_mnist.load(data), first)


def test_an_entry_gpulab_would_not_have_written_is_not_believed(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    first = fashion_mnist.load(data)
    entry = next(cache.iterdir())
    np.save(entry / "train_labels.npy", np.full(12, 200, dtype=np.uint8))  # labels out of range
    assert same(fashion_mnist.load(data), first)


def test_bad_source_files_are_still_refused(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    write_idx(data / "train-labels-idx1-ubyte.gz", np.zeros(11, dtype=np.uint8))  # 12 images, 11 labels
    with pytest.raises(UserError, match="12 images but .* has 11 labels"):
        fashion_mnist.load(data)
    assert not cache.exists() or not any(cache.iterdir())  # nothing kept of a refused set


def test_an_unwritable_cache_costs_only_the_decoding(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the cache folder would be")
    assert same(fashion_mnist.load(data), fashion_mnist.load(data))


def test_a_linked_entry_is_neither_read_nor_written_through(tmp_path, cache):
    data = write_set(tmp_path / "data", seed=0)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    cache.mkdir(parents=True)
    (cache / decoded.entry_name(fashion_mnist.find(data))).symlink_to(elsewhere)
    fashion_mnist.load(data)
    assert list(elsewhere.iterdir()) == []


def test_only_the_most_recent_entries_are_kept(tmp_path, cache):
    for seed in range(decoded.KEPT + 2):
        fashion_mnist.load(write_set(tmp_path / f"data{seed}", seed=seed))
    assert len(list(cache.iterdir())) == decoded.KEPT
