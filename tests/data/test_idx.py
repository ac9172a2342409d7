"""IDX files: round trips, and a one-line UserError naming the file for each kind of damage."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from gpulab.data import fashion_mnist
from gpulab.data.fashion_mnist import FILES
from gpulab.data.idx import read_idx, write_idx
from gpulab.errors import UserError


def idx_bytes(array: np.ndarray, magic: bytes | None = None) -> bytes:
    """An IDX file built by hand (independent of write_idx)."""
    array = np.asarray(array, dtype=np.uint8)
    head = magic if magic is not None else bytes([0, 0, 0x08, array.ndim])
    return head + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def images(n: int = 6, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


def expect_error(path: Path, expect_ndim: int, *fragments: str) -> str:
    with pytest.raises(UserError) as info:
        read_idx(path, expect_ndim=expect_ndim)
    message = str(info.value)
    assert str(path) in message
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message
    return message


# ----------------------------------------------------------------------------- good files


@pytest.mark.parametrize("name", ["x-idx3-ubyte", "x-idx3-ubyte.gz"])
def test_round_trip_raw_and_gz(tmp_path, name):
    a = images()
    write_idx(tmp_path / name, a)
    assert (tmp_path / name).read_bytes()[:2] == (b"\x1f\x8b" if name.endswith(".gz") else b"\x00\x00")
    b = read_idx(tmp_path / name, expect_ndim=3)
    assert b.dtype == np.uint8 and b.shape == (6, 28, 28)
    np.testing.assert_array_equal(a, b)


def test_reads_hand_built_raw_and_gzip(tmp_path):
    labels = np.array([0, 3, 9, 1], dtype=np.uint8)
    (tmp_path / "raw").write_bytes(idx_bytes(labels))
    (tmp_path / "zipped").write_bytes(gzip.compress(idx_bytes(labels)))  # detected by content, not name
    np.testing.assert_array_equal(read_idx(tmp_path / "raw", 1), labels)
    np.testing.assert_array_equal(read_idx(tmp_path / "zipped", 1), labels)


def test_empty_dataset_is_fine(tmp_path):
    (tmp_path / "f").write_bytes(idx_bytes(np.zeros((0,), np.uint8)))
    assert read_idx(tmp_path / "f", 1).shape == (0,)


# ----------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("magic", [b"\x00\x00\x0d\x03", b"\x01\x02\x08\x03", b"\x89PNG"])
def test_bad_magic_number(tmp_path, magic):
    path = tmp_path / "bad"
    path.write_bytes(idx_bytes(images(), magic=magic))
    expect_error(path, 3, "bad magic number", f"0x{magic.hex()}", "expected 0x00000803")


def test_wrong_number_of_dimensions(tmp_path):
    path = tmp_path / "labels-as-images"
    path.write_bytes(idx_bytes(np.zeros(10, np.uint8)))
    expect_error(path, 3, "has 1 dimensions, expected 3")


@pytest.mark.parametrize("cut", [1, 100])
def test_truncated_data(tmp_path, cut):
    path = tmp_path / "short"
    path.write_bytes(idx_bytes(images())[:-cut])
    expect_error(path, 3, "truncated", f"file has {6 * 784 - cut}")


def test_truncated_header(tmp_path):
    path = tmp_path / "header"
    path.write_bytes(idx_bytes(images())[:10])
    expect_error(path, 3, "truncated header")


@pytest.mark.parametrize("size", [0, 3])
def test_too_short_for_a_header(tmp_path, size):
    path = tmp_path / "tiny"
    path.write_bytes(b"\x00" * size)
    expect_error(path, 1, f"only {size} bytes", "truncated")


def test_trailing_bytes(tmp_path):
    path = tmp_path / "long"
    path.write_bytes(idx_bytes(images()) + b"\x00\x01")
    expect_error(path, 3, "trailing bytes", f"file has {6 * 784 + 2}")




@pytest.mark.parametrize(
    "damage",
    [
        lambda raw: raw[: len(raw) // 2],  # truncated stream: EOFError
        lambda raw: raw[:10] + bytes([raw[10] ^ 0xFF]) + raw[11:],  # broken deflate block: zlib.error
        lambda raw: raw[:-8] + bytes(8),  # CRC and length trailer zeroed: BadGzipFile
        lambda raw: raw[:2] + b"\x00" * 20,  # gzip magic, then junk: BadGzipFile
    ],
    ids=["truncated", "bad-block", "bad-crc", "bad-header"],
)
def test_corrupted_gzip(tmp_path, damage):
    path = tmp_path / "broken.gz"
    path.write_bytes(damage(gzip.compress(idx_bytes(images(50)))))
    expect_error(path, 3, "corrupted gzip data")


def test_unreadable_path(tmp_path):
    expect_error(tmp_path / "missing.gz", 3, "cannot read")
    expect_error(tmp_path, 3, "cannot read")  # a directory


# ----------------------------------------------------------------------------- whole dataset


def test_load_gz_dataset(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", num_train=40, num_test=20)
    train, test = fashion_mnist.load(folder)
    assert train.images.shape == (40, 1, 28, 28) and train.images.dtype == torch.uint8
    assert train.labels.shape == (40,) and train.labels.dtype == torch.int64
    assert len(test) == 20
    assert 0 <= int(train.labels.min()) and int(train.labels.max()) <= 9


def test_load_raw_and_gz_give_the_same_data(make_dataset, tmp_path):
    gz = make_dataset(tmp_path / "gz", num_train=30, num_test=10)
    raw = tmp_path / "raw"
    raw.mkdir()
    for stem in FILES.values():
        (raw / stem).write_bytes(gzip.decompress((gz / (stem + ".gz")).read_bytes()))
    a, b = fashion_mnist.load(gz), fashion_mnist.load(raw)
    for sa, sb in zip(a, b):
        assert (sa.images == sb.images).all() and (sa.labels == sb.labels).all()


def test_image_label_count_mismatch(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", num_train=30, num_test=10)
    write_idx(folder / (FILES["test_labels"] + ".gz"), np.zeros(11, np.uint8))
    with pytest.raises(UserError) as info:
        fashion_mnist.load(folder)
    message = str(info.value)
    assert "10 images" in message and "11 labels" in message
    assert FILES["test_labels"] in message and "\n" not in message


def test_label_out_of_range(make_dataset, tmp_path):
    folder = make_dataset(tmp_path / "d", num_train=30, num_test=10)
    labels = np.zeros(30, np.uint8)
    labels[7] = 10
    write_idx(folder / (FILES["train_labels"] + ".gz"), labels)
    with pytest.raises(UserError) as info:
        fashion_mnist.load(folder)
    message = str(info.value)
    assert "label 10 out of range 0..9" in message
    assert FILES["train_labels"] in message and "\n" not in message


def test_swapped_files_are_caught(make_dataset, tmp_path):
    """Labels in the images slot: the dimension check names the file."""
    folder = make_dataset(tmp_path / "d", num_train=30, num_test=10)
    images_path = folder / (FILES["train_images"] + ".gz")
    images_path.write_bytes((folder / (FILES["train_labels"] + ".gz")).read_bytes())
    with pytest.raises(UserError, match=f"{FILES['train_images']}.*1 dimensions, expected 3"):
        fashion_mnist.load(folder)
