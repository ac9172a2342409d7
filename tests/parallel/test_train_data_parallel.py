"""`gpulab train` on several (virtual) devices: same results as one device, scaled batch, errors."""

import json
import math

import pytest

from gpulab.cli import main


def metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())


def test_two_virtual_devices_match_one_device(tiny_data, tmp_path):
    # fp32: parity is a statement about the algorithm; bf16 rounding depends on the shard shapes.
    common = ["train", "--epochs", "2", "--batch-size", "64", "--seed", "3", "--precision", "fp32"]
    assert main([*common, "--devices", "cpu", "--out", str(tmp_path / "one")]) == 0
    assert main([*common, "--devices", "cpu*2", "--out", str(tmp_path / "two")]) == 0
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    for a, b in zip(one, two):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=1e-4)
        assert a["test_acc"] == pytest.approx(b["test_acc"], abs=0.005)
    assert len(two[-1]["allreduce_share"]) == 1 and 0 <= two[-1]["allreduce_share"][0] < 1


def test_scale_batch_multiplies_batch_and_lr(tiny_data, tmp_path, capsys):
    out = tmp_path / "scaled"
    assert main(["train", "--epochs", "1", "--devices", "cpu*2", "--batch-size", "32", "--lr", "0.05",
                 "--scale-batch", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "batch 64 (~32 per device)" in printed and "lr 0.1" in printed
    assert metrics(out)[0]["lr_peak"] == pytest.approx(0.1)


def test_more_devices_than_samples_is_a_clear_error(tiny_data, tmp_path, capsys):
    out = tmp_path / "never"
    assert main(["train", "--devices", "cpu*4", "--batch-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "smaller than the 4 devices" in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_allreduce_choice_reaches_the_run(tiny_data, tmp_path, capsys, monkeypatch, algorithm):
    import importlib

    allreduce_module = importlib.import_module("gpulab.parallel.allreduce")  # the module, not the function

    used = []
    for name in ("naive", "ring"):
        real = getattr(allreduce_module, f"_{name}")
        monkeypatch.setattr(allreduce_module, f"_{name}", lambda t, real=real, name=name: (used.append(name), real(t))[1])
    assert main(["train", "--epochs", "1", "--devices", "cpu*3", "--batch-size", "48", "--allreduce", algorithm,
                 "--out", str(tmp_path / algorithm)]) == 0
    assert used and set(used) == {algorithm}  # every gradient exchange ran the chosen algorithm
    assert f"allreduce {algorithm}" in capsys.readouterr().out


def test_resnet_with_sync_bn_runs_end_to_end(make_dataset, tmp_path):
    data = make_dataset(tmp_path / "small", num_train=96, num_test=32)  # ResNet-18 is slow on 2 cores
    out = tmp_path / "resnet"
    assert main(["train", "--model", "resnet18", "--epochs", "1", "--devices", "cpu*2", "--sync-bn",
                 "--batch-size", "32", "--data-dir", str(data), "--out", str(out)]) == 0
    # One epoch of 96 images trains nothing yet (sync BN's parity is tests/parallel/test_parity.py):
    # the run finished, with finite losses and a checkpoint a resume can load.
    row = metrics(out)[0]
    assert row["epoch"] == 1 and math.isfinite(row["train_loss"]) and math.isfinite(row["test_loss"])
    assert (out / "checkpoint.pt").exists()
