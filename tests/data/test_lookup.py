"""Where gpulab finds Fashion-MNIST: --data-dir (only there, when given); else $GPULAB_DATA >
cache dir > Debian's path.

Every test points all four places at temporary folders; nothing is ever downloaded
(`find(..., download=False)`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpulab.data import fashion_mnist
from gpulab.data.fashion_mnist import FILES
from gpulab.errors import UserError


@pytest.fixture
def places(tmp_path, monkeypatch) -> dict[str, Path]:
    """Four empty candidate folders, wired up as data_dir, $GPULAB_DATA, the cache and Debian's path."""
    folders = {name: tmp_path / name for name in ("arg", "env", "xdg", "debian")}
    for folder in folders.values():
        folder.mkdir()
    monkeypatch.setenv("GPULAB_DATA", str(folders["env"]))
    monkeypatch.setenv("XDG_CACHE_HOME", str(folders["xdg"]))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", folders["debian"])
    folders["cache"] = folders["xdg"] / "gpulab" / "fashion-mnist"
    folders["cache"].mkdir(parents=True)
    return folders


def fill(folder: Path, gz: bool = True, skip: str | None = None) -> Path:
    """Four (empty) files with the right names: lookup only checks names."""
    for key, stem in FILES.items():
        if key != skip:
            (folder / (stem + (".gz" if gz else ""))).write_bytes(b"")
    return folder


def found_in(paths: dict[str, Path]) -> Path:
    parents = {p.parent for p in paths.values()}
    assert len(parents) == 1, "the four files must come from one folder"
    assert set(paths) == set(FILES)
    return parents.pop()


def test_cache_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert fashion_mnist.cache_dir() == tmp_path / "gpulab" / "fashion-mnist"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert fashion_mnist.cache_dir() == tmp_path / "home" / ".cache" / "gpulab" / "fashion-mnist"


def test_data_dir_wins_over_everything(places):
    for name in ("arg", "env", "cache", "debian"):
        fill(places[name])
    assert found_in(fashion_mnist.find(places["arg"])) == places["arg"]


def test_env_wins_over_cache_and_debian(places):
    for name in ("env", "cache", "debian"):
        fill(places[name])
    assert found_in(fashion_mnist.find()) == places["env"]


@pytest.mark.parametrize("skip", [None, "test_labels"])
def test_an_explicit_data_dir_without_the_files_never_falls_through(places, skip):
    """--data-dir names the data to train on: other data elsewhere must not stand in for it."""
    for name in ("env", "cache", "debian"):
        fill(places[name])
    if skip:
        fill(places["arg"], skip=skip)
    with pytest.raises(UserError) as info:
        fashion_mnist.find(places["arg"], download=True)
    message = str(info.value)
    assert "\n" not in message and f"--data-dir {places['arg']} lacks" in message
    missing = [FILES[skip]] if skip else list(FILES.values())
    assert all(stem in message for stem in missing)
    assert all(stem not in message for stem in FILES.values() if stem not in missing)


def test_cache_wins_over_debian(places):
    fill(places["cache"])
    fill(places["debian"])
    assert found_in(fashion_mnist.find()) == places["cache"]


def test_debian_path_is_the_last_resort(places):
    fill(places["debian"])
    assert found_in(fashion_mnist.find()) == places["debian"]


def test_a_folder_missing_one_file_is_skipped(places):
    fill(places["env"], skip="test_labels")
    fill(places["debian"])
    assert found_in(fashion_mnist.find()) == places["debian"]


def test_raw_files_are_found_and_gz_preferred(places):
    fill(places["env"], gz=False)
    paths = fashion_mnist.find()
    assert paths["train_images"] == places["env"] / FILES["train_images"]
    fill(places["env"], gz=True)
    assert fashion_mnist.find()["train_images"] == places["env"] / (FILES["train_images"] + ".gz")


def test_missing_everywhere_lists_three_ways(places):
    with pytest.raises(UserError) as info:
        fashion_mnist.find(download=False)
    message = str(info.value)
    assert "\n" not in message
    assert "Fashion-MNIST not found" in message
    for name in ("env", "cache", "debian"):
        assert str(places[name]) in message  # every searched folder
    assert "(1) sudo apt-get install dataset-fashion-mnist" in message
    assert "(2)" in message and "--data-dir" in message and "GPULAB_DATA" in message
    assert f"(3) run once with network access to download into {places['cache']}" in message


def test_missing_everywhere_without_env(places, monkeypatch):
    monkeypatch.delenv("GPULAB_DATA")
    with pytest.raises(UserError, match="three ways"):
        fashion_mnist.find(download=False)


def test_data_dir_that_does_not_exist(places):
    fill(places["env"])
    missing = places["arg"] / "nope"
    with pytest.raises(UserError, match=f"--data-dir {missing} does not exist"):
        fashion_mnist.find(missing)


def test_a_gpulab_data_that_is_not_a_folder_is_refused_not_passed_over(places, monkeypatch):
    monkeypatch.setenv("GPULAB_DATA", str(places["env"] / "typo"))
    with pytest.raises(UserError, match="GPULAB_DATA=.*typo is not a folder"):
        fashion_mnist.find()
