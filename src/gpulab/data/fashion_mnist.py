"""Fashion-MNIST: where to find it, how to load it, and what to say when it is missing.

An explicit `--data-dir` (the `data_dir` argument) is the only place looked at: without all
four files there it is an error naming the missing ones, never a silent fall-back to other
data. Without one, the lookup order is (first directory that holds all four files wins):
  1. `$GPULAB_DATA`
  2. the user cache dir (`$XDG_CACHE_HOME/gpulab/fashion-mnist`, default `~/.cache/...`)
  3. `/usr/share/datasets/fashion-mnist` (Debian's `dataset-fashion-mnist` package)
When none has it, gpulab downloads into the cache dir if `download=True` and the network
allows; otherwise it stops with an error listing the ways to get the data.
"""

from __future__ import annotations

import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gpulab.data import decoded
from gpulab.data.idx import read_idx
from gpulab.errors import UserError
from gpulab.io import cache_dir as gpulab_cache_dir

FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}
CLASSES = ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot")
DEBIAN_DIR = Path("/usr/share/datasets/fashion-mnist")
MIRRORS = (
    "https://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
    "https://raw.githubusercontent.com/zalandoresearch/fashion-mnist/master/data/fashion/",
)


@dataclass
class Split:
    """One split of an image-classification dataset, kept compact: uint8 images, int64 labels."""

    images: torch.Tensor  # uint8 [N, 1, H, W]
    labels: torch.Tensor  # int64 [N]

    def __len__(self) -> int:
        return len(self.labels)


def cache_dir() -> Path:
    return gpulab_cache_dir() / "fashion-mnist"


def candidate_dirs(data_dir: str | os.PathLike | None = None) -> list[Path]:
    dirs = []
    if data_dir:
        dirs.append(Path(data_dir))
    if os.environ.get("GPULAB_DATA"):
        env = Path(os.environ["GPULAB_DATA"])
        if not env.is_dir():  # a typo: quietly reading the cache's copy instead would hide it
            raise UserError(f"GPULAB_DATA={env} is not a folder; point it at the folder that holds the "
                            "Fashion-MNIST IDX files, or unset it")
        dirs.append(env)
    dirs += [cache_dir(), DEBIAN_DIR]
    return dirs


def _file_in(directory: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        # exists(), not is_file(): a FIFO or device under the right name is found, so that
        # read_idx says what it is rather than the folder seeming to lack the file.
        if (directory / name).exists():
            return directory / name
    return None


def find(data_dir: str | os.PathLike | None = None, download: bool = False) -> dict[str, Path]:
    """Paths of the four IDX files: in `data_dir` when given (and only there), else searched in
    lookup order."""
    if data_dir is not None:
        return find_in(Path(data_dir))
    for d in candidate_dirs(data_dir):
        found = {k: _file_in(d, stem) for k, stem in FILES.items()}
        if all(found.values()):
            return found
    if download:
        try:
            return _download(cache_dir())
        except OSError:
            pass  # no network: fall through to the explanation
    searched = ", ".join(str(d) for d in candidate_dirs(data_dir))
    raise UserError(
        f"Fashion-MNIST not found (searched {searched}); get it one of three ways: "
        "(1) sudo apt-get install dataset-fashion-mnist, "
        "(2) put the four *-ubyte.gz files in a folder and pass --data-dir DIR or set GPULAB_DATA=DIR, "
        f"(3) run once with network access to download into {cache_dir()}"
    )


def find_in(data_dir: Path) -> dict[str, Path]:
    """The four files in the folder the user named, or an error naming the missing ones."""
    if data_dir.exists() and not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} is a file, not a folder; point it at the folder that holds the "
                        "Fashion-MNIST IDX files")
    if not data_dir.is_dir():
        raise UserError(f"--data-dir {data_dir} does not exist; point it at a folder with the Fashion-MNIST IDX files")
    found = {key: _file_in(data_dir, stem) for key, stem in FILES.items()}
    missing = [FILES[key] for key, path in found.items() if path is None]
    if missing:
        raise UserError(
            f"--data-dir {data_dir} lacks {', '.join(f'{stem}(.gz)' for stem in missing)}: put the four Fashion-MNIST "
            "IDX files there, or leave out --data-dir to use $GPULAB_DATA, the cache or Debian's dataset-fashion-mnist"
        )
    return found


def _download(target: Path) -> dict[str, Path]:
    target.mkdir(parents=True, exist_ok=True)
    paths = {}
    for key, stem in FILES.items():
        dest = target / (stem + ".gz")
        if not dest.exists():
            last_error: OSError | None = None
            for mirror in MIRRORS:
                try:
                    tmp = dest.with_name(dest.name + ".part")
                    with urllib.request.urlopen(mirror + stem + ".gz", timeout=10) as r:
                        tmp.write_bytes(r.read())
                    tmp.replace(dest)
                    break
                except OSError as e:
                    last_error = e
            else:
                raise last_error or OSError("no mirror answered")
        paths[key] = dest
    return paths


def load(data_dir: str | os.PathLike | None = None, download: bool = False) -> tuple[Split, Split]:
    """(train, test) splits, validated: shapes, image/label counts and label range. The files are
    decoded once; later runs read the decoded arrays from gpulab's cache (gpulab.data.decoded)."""
    paths = find(data_dir, download)
    arrays = decoded.read(decoded_dir(), paths)
    if arrays is None or splits_problem(paths, arrays):  # an entry gpulab would not have written: decode
        arrays = {key: read_idx(path, expect_ndim=3 if key.endswith("images") else 1) for key, path in paths.items()}
        problem = splits_problem(paths, arrays)
        if problem:
            raise UserError(problem)
        decoded.write(decoded_dir(), paths, arrays)
    return tuple(
        Split(images=torch.from_numpy(np.array(arrays[f"{part}_images"])).unsqueeze(1),
              labels=torch.from_numpy(arrays[f"{part}_labels"].astype(np.int64)))
        for part in ("train", "test")
    )


def decoded_dir() -> Path:
    return gpulab_cache_dir() / "fashion-mnist-decoded"


def splits_problem(paths: dict[str, Path], arrays: dict[str, np.ndarray]) -> str | None:
    """What keeps the splits from being Fashion-MNIST's (images 28x28, as many images as labels,
    labels 0..9), in one line naming the file; None when they are."""
    for part in ("train", "test"):
        images, labels = arrays[f"{part}_images"], arrays[f"{part}_labels"]
        images_path, labels_path = paths[f"{part}_images"], paths[f"{part}_labels"]
        if images.ndim != 3 or labels.ndim != 1:
            return f"{images_path}: not N images of H x W beside {labels_path}'s N labels"
        if len(images) == 0:
            return f"{images_path} holds no images: the {part} split is empty; use the full dataset"
        if images.shape[1:] != (28, 28):
            return (f"{images_path}: images are {images.shape[1]}x{images.shape[2]}, but Fashion-MNIST's are "
                    "28x28: wrong files? (other images: pass them to gpulab.train.train() as train_data/test_data)")
        if len(images) != len(labels):
            return (f"{images_path} has {len(images)} images but {labels_path} has {len(labels)} labels; the two "
                    "files are from different datasets")
        if labels.size and labels.max() >= len(CLASSES):
            return f"{labels_path}: label {int(labels.max())} out of range 0..{len(CLASSES) - 1}"
    return None


def write_subset(folder: Path, num_train: int, num_test: int = 256, data_dir: str | os.PathLike | None = None) -> Path:
    """The first `num_train` training and `num_test` test images as IDX files in `folder`: a
    small copy of the dataset for runs that time steps rather than train (benchmarks, plan --check)."""
    from gpulab.data.idx import write_idx

    train, test = load(data_dir)
    folder.mkdir(parents=True, exist_ok=True)
    for part, split, n in (("train", train, num_train), ("test", test, num_test)):
        write_idx(folder / (FILES[f"{part}_images"] + ".gz"), split.images[:n, 0].numpy())
        write_idx(folder / (FILES[f"{part}_labels"] + ".gz"), split.labels[:n].numpy().astype("uint8"))
    return folder
