"""The trainer on a tiny IDX dataset (conftest's `tiny_data`): run dirs, determinism, resume,
learning, virtual replicas, and divergence. Each run is 1-3 short epochs."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from rich.console import Console

from gpulab.errors import UserError
from gpulab.train import RECIPES, TrainConfig, train
from gpulab.train.recipe import lr_at
from gpulab.train.rundir import CHECKPOINT, LOCK, RunDir, check_writable, default_run_dir

MEASURED_KEYS = {"train_seconds", "samples_per_s", "phases_s", "allreduce_share", "eval_seconds", "peak_memory",
                 "core_wait_share", "cores_contended", "threads_to_try", "first_step_s", "wall_s"}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(out: Path, **overrides) -> TrainConfig:
    args = dict(devices="cpu", epochs=2, batch_size=32, out=str(out))
    args.update(overrides)
    return TrainConfig(**args)


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=False)["strategy"]["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), f"{name} differs"


def metrics(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "metrics.json").read_text())


def deterministic(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in MEASURED_KEYS} for row in rows]


class Crash(Exception):
    pass


def crash_after(epoch: int, exc: type[BaseException] = KeyboardInterrupt):
    def on_epoch_end(row: dict) -> None:
        if row["epoch"] == epoch:
            raise exc()

    return on_epoch_end


# ----------------------------------------------------------------------------- run directory


def test_run_dir_contents(tiny_data, tmp_path):
    out = tmp_path / "run"
    final = train(config(out, epochs=2))
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "metrics.json", "metrics.csv", "curves.png", CHECKPOINT, LOCK]
    )
    saved = json.loads((out / "config.json").read_text())
    expected = config(out, epochs=2, input_shape=[1, 28, 28])  # the input shape is learnt from the data
    assert saved == expected.to_dict()
    assert TrainConfig.from_dict(saved) == expected

    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1, 2]
    assert rows[-1] == final
    for row in rows:
        for key in ("train_loss", "train_acc", "test_loss", "test_acc", "train_seconds", "samples_per_s", "lr_peak"):
            assert isinstance(row[key], float) and math.isfinite(row[key]), key
        assert 0 <= row["train_acc"] <= 1 and 0 <= row["test_acc"] <= 1
    # What the user waited, from the process's start: for the first step, for each epoch's result.
    assert 0 < rows[0]["first_step_s"] < rows[0]["wall_s"] < rows[1]["wall_s"]
    assert "first_step_s" not in rows[1]
    with open(out / "metrics.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [int(r["epoch"]) for r in table] == [1, 2]
    assert float(table[1]["test_acc"]) == rows[1]["test_acc"]
    assert "phases_s" not in table[0]  # nested values stay in the JSON only
    for r, row in zip(table, rows):  # per-device lists are numbers, not "[9.5e-05]"
        shares = [float(r[k]) for k in r if k.startswith("allreduce_share")]
        assert shares == pytest.approx(row["allreduce_share"])
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    checkpoint = torch.load(out / CHECKPOINT, map_location="cpu", weights_only=False)
    assert checkpoint["epoch"] == 2 and checkpoint["history"] == rows
    assert set(checkpoint["strategy"]) == {"model", "optimizer"}
    assert not list(out.glob(".*.tmp"))  # atomic writes leave no temporaries behind


def test_same_config_twice_is_identical(tiny_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(config(a))
    train(config(b))
    assert deterministic(metrics(a)) == deterministic(metrics(b))
    assert_same_weights(a, b)


def test_another_seed_gives_other_weights(tiny_data, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    train(config(a, epochs=1))
    train(config(b, epochs=1, seed=1))
    assert not torch.equal(weights(a)["fc1.weight"], weights(b)["fc1.weight"])


# ----------------------------------------------------------------------------- resume


@pytest.mark.parametrize("devices", ["cpu", "cpu*2"])
def test_resume_after_a_crash_equals_an_uninterrupted_run(tiny_data, tmp_path, devices):
    whole, crashed = tmp_path / "whole", tmp_path / "crashed"
    train(config(whole, epochs=3, devices=devices))

    with pytest.raises(KeyboardInterrupt):
        train(config(crashed, epochs=3, devices=devices), on_epoch_end=crash_after(1))
    assert [r["epoch"] for r in metrics(crashed)] == [1]
    assert torch.load(crashed / CHECKPOINT, weights_only=False)["epoch"] == 1

    final = train(resume=str(crashed))
    assert final["epoch"] == 3
    assert "first_step_s" in metrics(crashed)[1]  # the resumed process's first step
    assert_same_weights(whole, crashed)
    assert deterministic(metrics(crashed)) == deterministic(metrics(whole))


def test_the_next_epoch_trains_while_the_checkpoint_is_written_from_a_copy(tiny_data, tmp_path, monkeypatch):
    """Epoch 1's checkpoint is written while epoch 2 trains - it is still being written when epoch
    2's steps are done - and holds epoch 1's weights, not what epoch 2 made of them: the same as a
    run of one epoch. The last epoch's is waited for."""
    from gpulab.train import loop

    train(config(tmp_path / "one", epochs=1, recipe="textbook"))  # a constant learning rate: epoch 1 of 2 is this
    second_epoch_trained = threading.Event()
    real_run_epoch, real_save = loop.run_epoch, RunDir.save_checkpoint
    saved, overlapped = {}, []

    def run_epoch(run, epoch, progress=None):
        row = real_run_epoch(run, epoch, progress)
        if epoch == 1:
            second_epoch_trained.set()
        return row

    def save_checkpoint(self, state):
        if state["epoch"] == 1:
            overlapped.append(second_epoch_trained.wait(timeout=30))
            saved.update(state["strategy"]["model"])
        real_save(self, state)

    monkeypatch.setattr(loop, "run_epoch", run_epoch)
    monkeypatch.setattr(RunDir, "save_checkpoint", save_checkpoint)
    train(config(tmp_path / "two", epochs=2, recipe="textbook"))
    assert overlapped == [True]
    one = weights(tmp_path / "one")
    assert all(torch.equal(saved[name], one[name]) for name in one)
    assert torch.load(tmp_path / "two" / CHECKPOINT, weights_only=False)["epoch"] == 2


def test_resume_of_a_finished_run_trains_nothing_and_says_so(tiny_data, tmp_path):
    out = tmp_path / "run"
    train(config(out, epochs=1))
    before = (out / CHECKPOINT).read_bytes()
    console = Console(record=True, soft_wrap=True)  # no wrap: a long tmp path would split the command
    final = train(resume=str(out), console=console)
    assert final["epoch"] == 1
    assert (out / CHECKPOINT).read_bytes() == before
    said = console.export_text()
    assert f"{out} is complete: 1 of 1 epochs trained" in said and "--epochs N" in said


def test_a_finished_run_extended_with_more_epochs_equals_the_longer_run(tiny_data, tmp_path):
    # A constant learning rate (the textbook recipe): 1 epoch, then 2 more, is a 3-epoch run.
    whole, extended = tmp_path / "whole", tmp_path / "extended"
    train(config(whole, epochs=3, recipe="textbook"))
    train(config(extended, epochs=1, recipe="textbook"))
    final = train(resume=str(extended), epochs=3)
    assert final["epoch"] == 3
    assert_same_weights(whole, extended)
    assert deterministic(metrics(extended)) == deterministic(metrics(whole))
    assert json.loads((extended / "config.json").read_text())["epochs"] == 3


def test_resuming_a_crashed_run_with_its_own_total_is_not_called_extending(tiny_data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config(out, epochs=2), on_epoch_end=crash_after(1))
    console = Console(record=True, width=200)
    assert train(resume=str(out), epochs=2, console=console)["epoch"] == 2
    assert "extending" not in console.export_text()


def test_extending_a_run_to_fewer_epochs_than_it_has_is_refused(tiny_data, tmp_path):
    out = tmp_path / "run"
    train(config(out, epochs=2))
    with pytest.raises(UserError, match="--epochs 1: .* has already trained 2 epochs; give a total of 2 or more"):
        train(resume=str(out), epochs=1)
    assert json.loads((out / "config.json").read_text())["epochs"] == 2


def test_resume_without_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        train(config(out, epochs=1), on_epoch_end=crash_after(1, Crash))
    (out / CHECKPOINT).unlink()
    with pytest.raises(UserError, match=f"no {CHECKPOINT}"):
        train(resume=str(out))


def test_resume_of_a_dir_that_is_not_a_run(tiny_data, tmp_path):
    with pytest.raises(UserError, match="no readable config.json"):
        train(resume=str(tmp_path))
    with pytest.raises(UserError, match="no readable config.json"):
        train(resume=str(tmp_path / "missing"))
    assert not (tmp_path / "missing").exists()


# ----------------------------------------------------------------------------- learning


def test_training_learns(tiny_data, tmp_path):
    out = tmp_path / "run"
    final = train(config(out, epochs=3))
    rows = metrics(out)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert final["test_acc"] >= 0.6  # chance is 0.1


def test_textbook_recipe_trains(tiny_data, tmp_path):
    out = tmp_path / "run"
    final = train(config(out, epochs=1, recipe="textbook"))
    assert final["lr_peak"] == RECIPES["textbook"].lr
    assert math.isfinite(final["train_loss"])
    # the N(0, 0.01^2) init starts at chance: every logit ~0, so the loss is ~ln 10
    assert final["train_loss"] == pytest.approx(math.log(10), abs=0.05)


def test_textbook_recipe_needs_lenet(tiny_data, tmp_path):
    with pytest.raises(UserError, match="use --model lenet"):
        train(config(tmp_path / "run", recipe="textbook", model="resnet18"))


def test_two_virtual_cpus_train(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    final = train(config(out, epochs=3, devices="cpu*2"))
    assert "[cpu*2]" in capsys.readouterr().out
    rows = metrics(out)
    assert [len(r["allreduce_share"]) for r in rows] == [1, 1, 1]
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert final["test_acc"] >= 0.6


def test_virtual_cpus_compute_what_one_cpu_does(tiny_data, tmp_path):
    """Data parallelism over cpu*2 is the same model as 1 device, up to float summation order
    (in fp32: bf16 autocast rounds differently for different shard shapes)."""
    one, two = tmp_path / "one", tmp_path / "two"
    train(config(one, epochs=1, precision="fp32"))
    train(config(two, epochs=1, devices="cpu*2", precision="fp32"))
    w1, w2 = weights(one), weights(two)
    for name in w1:
        torch.testing.assert_close(w1[name], w2[name], rtol=1e-4, atol=1e-5)


def test_batch_smaller_than_device_count(tiny_data, tmp_path):
    with pytest.raises(UserError, match="smaller than the 4 devices"):
        train(config(tmp_path / "run", devices="cpu*4", batch_size=3))
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- divergence


def test_divergence_in_the_first_epoch_says_there_is_no_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(UserError) as info:
        train(config(out, lr=1e6))
    message = str(info.value)
    assert "\n" not in message
    assert "epoch 1: the training loss became" in message
    assert "lower --lr" in message
    assert "no checkpoint" in message
    assert "last good checkpoint" not in message
    assert not (out / CHECKPOINT).exists()


def test_divergence_later_keeps_the_last_good_checkpoint(tiny_data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        train(config(out, epochs=3), on_epoch_end=crash_after(1, Crash))
    good = (out / CHECKPOINT).read_bytes()
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "lr": 1e6}))  # epoch 2 now diverges

    with pytest.raises(UserError) as info:
        train(resume=str(out))
    message = str(info.value)
    assert "epoch 2: the training loss became" in message
    assert f"last good checkpoint (epoch 1) kept in {out}" in message
    assert (out / CHECKPOINT).read_bytes() == good
    assert [r["epoch"] for r in metrics(out)] == [1]


# ----------------------------------------------------------------------------- pieces


def test_config_validation():
    for bad, match in (
        (dict(model="vgg"), "--model vgg: unknown model"),
        (dict(data="cifar10"), "--data cifar10: choose one of fashion-mnist, custom"),
        (dict(recipe="fast"), "--recipe fast: choose one of modern, textbook"),
        (dict(epochs=0), "at least 1 epoch"),
        (dict(batch_size=0), "batch size must be >= 1"),
        (dict(eval_batch_size=0), "must be >= 1"),
        (dict(lr=0.0), "positive number"),
        (dict(lr=-0.1), "positive number"),
        (dict(lr=float("nan")), "positive number"),
        (dict(lr=float("inf")), "positive number"),
        (dict(channels_last="maybe"), "--channels-last maybe: choose one of auto, on, off"),
        (dict(allreduce="carrier-pigeon"), "--allreduce carrier-pigeon: choose one of auto, naive, ring, nccl"),
        (dict(sync="horovod"), "--sync horovod: choose one of gpulab, ddp"),
        (dict(backend="mpi"), "--backend mpi: choose one of auto, gloo, nccl"),
    ):
        with pytest.raises(UserError, match=match):
            TrainConfig(**bad)


def test_config_round_trip_ignores_unknown_keys():
    cfg = TrainConfig(model="resnet18", epochs=3, lr=0.05, devices="cpu*2")
    assert TrainConfig.from_dict({**cfg.to_dict(), "from_the_future": 1}) == cfg


def test_lr_schedules():
    constant = RECIPES["textbook"]
    assert [lr_at(s, 10, 0.2, constant) for s in range(10)] == [0.2] * 10
    assert [lr_at(s, 10, 0.2, constant, warmup_steps=4) for s in range(5)] == pytest.approx([0.05, 0.1, 0.15, 0.2, 0.2])

    onecycle = RECIPES["modern"]  # 15% warm-up, then cosine down to 0
    lrs = [lr_at(s, 100, 1.0, onecycle) for s in range(100)]
    assert lrs[0] == pytest.approx(1 / 15)
    assert lrs[14] == pytest.approx(1.0) and lrs[15] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[15:], lrs[16:]))
    assert 0 < lrs[-1] < 0.001
    assert max(lrs) == pytest.approx(1.0)


def test_check_writable(tmp_path):
    check_writable(tmp_path / "new" / "deeper")  # a path that can be created
    assert not (tmp_path / "new").exists()  # ... and checking creates nothing
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(UserError, match="is a file"):
        check_writable(a_file)
    with pytest.raises(UserError, match=f"{a_file}"):
        check_writable(a_file / "run")
    a_file.chmod(0o755)  # even executable (root passes os.access X_OK then), a file is not a folder
    with pytest.raises(UserError, match=f"{a_file}"):
        check_writable(a_file / "run" / "deeper")


def test_default_run_dir():
    path = default_run_dir("lenet")
    assert path.parent == Path("runs") and path.name.endswith("-lenet")


def test_rundir_writes_are_atomic_replacements(tmp_path):
    run = RunDir(tmp_path)
    run.write_config({"a": 1})
    run.write_config({"a": 2})
    assert run.read_config() == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


# ----------------------------------------------------------------------------- real data (slow)


@pytest.mark.slow
def test_lenet_reaches_90_percent_on_fashion_mnist(tmp_path):
    """The default recipe's promise: LeNet, 10 epochs, real Fashion-MNIST, test accuracy >= 0.90."""
    from gpulab.data import fashion_mnist

    try:
        fashion_mnist.find(download=False)
    except UserError as e:
        pytest.skip(f"real Fashion-MNIST not available: {e}")
    out = tmp_path / "run"
    final = train(TrainConfig(model="lenet", epochs=10, out=str(out)))
    assert final["epoch"] == 10
    assert final["test_acc"] >= 0.90


def test_out_dir_holding_a_run_is_not_overwritten(tiny_data, tmp_path):
    out = tmp_path / "run"
    train(config(out, epochs=1))
    before = (out / CHECKPOINT).read_bytes()
    with pytest.raises(UserError, match="already holds a gpulab run"):
        train(config(out, epochs=1))
    assert (out / CHECKPOINT).read_bytes() == before


# ----------------------------------------------------------------------------- the user's own data


def user_datasets(n_train=96, n_test=40):
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(10, 1, 28, 28, generator=g)

    def make(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return torch.utils.data.TensorDataset(prototypes[y] + 0.3 * torch.randn(n, 1, 28, 28, generator=g), y)

    return make(n_train), make(n_test)


@pytest.mark.parametrize("as_loader", [False, True])
def test_train_on_a_users_dataset_or_dataloader(tmp_path, as_loader, monkeypatch):
    monkeypatch.setenv("GPULAB_DATA", str(tmp_path / "nowhere"))  # Fashion-MNIST must not be needed
    train_set, test_set = user_datasets()
    if as_loader:
        train_set = torch.utils.data.DataLoader(train_set, batch_size=32, shuffle=True)
        test_set = torch.utils.data.DataLoader(test_set, batch_size=64)
    out = tmp_path / "run"
    final = train(config(out, epochs=8, devices="cpu*2", batch_size=32), train_data=train_set, test_data=test_set)
    assert final["test_acc"] > 0.5  # 10 well-separated classes: far above chance (0.1)
    assert json.loads((out / "config.json").read_text())["data"] == "custom"
    with pytest.raises(UserError, match="pass train_data and test_data"):
        train(resume=str(out))


def test_the_banner_says_the_batch_your_dataloader_uses(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAB_DATA", str(tmp_path / "nowhere"))
    train_set, test_set = user_datasets()
    loader = torch.utils.data.DataLoader(train_set, batch_size=20, shuffle=True)
    console = Console(record=True, width=300)
    train(config(tmp_path / "run", epochs=1, devices="cpu*2"), train_data=loader, test_data=test_set, console=console)
    said = console.export_text()
    assert "batch 20 (~10 per device)" in said and "batch 32" not in said  # not the config's batch_size


def test_train_data_without_test_data_is_refused(tmp_path):
    train_set, _ = user_datasets()
    with pytest.raises(UserError, match="both train_data and test_data"):
        train(config(tmp_path / "run"), train_data=train_set)


def test_precision_choice(tiny_data, tmp_path, capsys):
    from gpulab.devices import resolve
    from gpulab.train.precision import autocast_dtype

    assert autocast_dtype(TrainConfig(precision="fp32"), resolve("cpu"), "off") is None
    assert autocast_dtype(TrainConfig(precision="bf16"), resolve("cpu"), "off") is torch.bfloat16
    with pytest.raises(UserError, match="--precision fp16: choose one of auto, fp32, bf16"):
        TrainConfig(precision="fp16")
    train(config(tmp_path / "run", epochs=1, precision="bf16"))
    assert "bf16 autocast" in capsys.readouterr().out


@pytest.mark.parametrize("compile, bf16_in_hardware, expected", [
    ("record", True, torch.bfloat16),  # a recorded step on a bf16 GPU: measured faster in bf16
    ("graphs", True, torch.bfloat16),
    ("graphs", False, None),            # no bf16 in hardware (pre-Ampere): fp32
    ("on", True, None),                 # not recorded: fp32
    ("off", True, None),
])
def test_auto_precision_on_cuda_is_bf16_only_for_a_recorded_step(monkeypatch, compile, bf16_in_hardware, expected):
    from gpulab.train import precision

    monkeypatch.setattr(precision, "native_bf16", lambda device: bf16_in_hardware)
    cuda = [torch.device("cuda", 0)]  # a device object only: nothing runs on it
    assert precision.autocast_dtype(TrainConfig(precision="auto"), cuda, compile) is expected
    assert precision.autocast_dtype(TrainConfig(precision="fp32"), cuda, compile) is None


def test_user_images_of_the_wrong_shape_are_a_clear_error(tmp_path):
    rgb = torch.utils.data.TensorDataset(torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.long))
    with pytest.raises(UserError, match="images have shape 3x32x32; --model lenet takes 1x28x28"):
        train(config(tmp_path / "run"), train_data=rgb, test_data=rgb)
    assert not (tmp_path / "run").exists()


def test_warmup_never_takes_the_whole_run():
    recipe = RECIPES["modern"]
    lrs = [lr_at(s, 10, 1.0, recipe, warmup_steps=10) for s in range(10)]
    assert max(lrs) == pytest.approx(1.0) and lrs[-1] < 0.2  # peaks, then decays


def test_resume_of_a_damaged_checkpoint_is_a_one_line_error(tiny_data, tmp_path):
    out = tmp_path / "run"
    train(config(out, epochs=1))
    good = (out / CHECKPOINT).read_bytes()
    for cut in (100, 5000):  # torch's zip reader fails on the first; the second is a seek before the file's start (EINVAL)
        (out / CHECKPOINT).write_bytes(good[:cut])
        with pytest.raises(UserError, match="checkpoint.pt is unreadable .*; it is damaged"):
            train(resume=str(out))
    (out / CHECKPOINT).write_bytes(good)  # now the config alone is damaged
    (out / "config.json").write_text('{"epochs": "ten"}')
    with pytest.raises(UserError, match="config.json: epochs is \"ten\", not a whole number"):
        train(resume=str(out))


def test_each_epoch_records_its_peak_memory(tiny_data, tmp_path, capsys):
    train(config(tmp_path / "a", epochs=2))
    for row in metrics(tmp_path / "a"):
        assert set(row["peak_memory"]) == {"cpu"}  # one process: its peak resident memory
        assert 50 * 2**20 < row["peak_memory"]["cpu"] < 16 * 2**30  # this process: the test run's, all of it
    assert re.search(r"sec/epoch on \[cpu\], peak resident memory [\d.]+ [MG]iB on cpu", capsys.readouterr().out)


PEAK_AFTER_RESET = """
import torch
from gpulab.memory.peak import peak_memory, reset_peaks
cpu = [torch.device("cpu")]
x = torch.ones(50_000_000)  # 200 MB, touched, then given back (an mmap of its own)
del x
before = peak_memory(cpu)["cpu"]
assert reset_peaks(cpu)
print(before, peak_memory(cpu)["cpu"])
"""


def test_the_peak_is_counted_anew_after_a_reset():
    # In a fresh process: in this one, earlier tests leave freed heap resident (gpulab's malloc
    # settings keep it for reuse), so 200 MB more need not raise its peak at all.
    out = subprocess.run([sys.executable, "-c", PEAK_AFTER_RESET], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert after < before - 150 * 2**20
