"""Reliability of a run (issue #10, part 3): a run owns its directory, never writes over the user's
files or trains on other data than it was given, can always be started again or resumed, says
every failure in one line, and stops a diverging run early without keeping an exploded epoch.

Tiny synthetic data (conftest's `tiny_data`: 512 training samples, 16 steps of 32), 1-2 epochs.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_one_line_error, run_cli
from gpulab.errors import UserError
from gpulab.parallel.launch import LAUNCHED_BY_GPULAB
from gpulab.train import TrainConfig, train
from gpulab.train import loop, rundir
from gpulab.train.resume import interrupted_line, resume_hint, saved_config
from gpulab.train.rundir import CHECKPOINT
from gpulab.train.step import Trainer


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def config(out: Path | None, **overrides) -> TrainConfig:
    args = dict(devices="cpu", epochs=1, batch_size=32, out=None if out is None else str(out))
    args.update(overrides)
    return TrainConfig(**args)


def saved_epoch(run_dir: Path) -> int:
    return torch.load(run_dir / CHECKPOINT, map_location="cpu", weights_only=False)["epoch"]






def during_first_epoch(monkeypatch, action):
    """Call `action()` once, at the start of the first epoch trained (the directory is claimed, no
    checkpoint yet): a second run started while the first one is working."""
    real = loop.run_epoch
    calls = []

    def run_epoch(run, epoch, progress=None):
        if not calls:
            calls.append(epoch)
            action()
        return real(run, epoch, progress)

    monkeypatch.setattr(loop, "run_epoch", run_epoch)


def stop(row: dict) -> None:
    """on_epoch_end that stops the run after its first epoch, as Ctrl-C would."""
    raise KeyboardInterrupt


TRAIN = ["train", "--devices", "cpu", "--epochs", "1", "--batch-size", "32"]


# ----------------------------------------------------------------------------- 1. a run owns its directory


def test_a_second_run_into_a_directory_in_use_is_refused(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    refusals = []

    def second_run():
        with pytest.raises(UserError) as info:
            train(config(out, seed=2))
        refusals.append(str(info.value))

    during_first_epoch(monkeypatch, second_run)
    train(config(out, seed=1))
    [message] = refusals
    assert "\n" not in message
    assert f"--out {out} is in use by another gpulab run (pid {os.getpid()}" in message
    assert "choose another --out" in message
    assert json.loads((out / "config.json").read_text())["seed"] == 1  # the first run's, untouched


def test_resuming_a_run_that_is_still_training_is_refused(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    train(config(out))  # a checkpoint to resume from
    (out / "config.json").write_text(json.dumps({**json.loads((out / "config.json").read_text()), "epochs": 2}))
    refusals = []

    def resume_meanwhile():
        with pytest.raises(UserError) as info:
            train(resume=str(out))
        refusals.append(str(info.value))

    during_first_epoch(monkeypatch, resume_meanwhile)
    train(resume=str(out))  # trains epoch 2 while the second --resume tries to
    [message] = refusals
    assert f"--resume {out}: in use by another gpulab run (pid {os.getpid()}" in message
    assert saved_epoch(out) == 2


def test_the_lock_is_released_when_the_run_ends(tiny_data, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config(out, epochs=2), on_epoch_end=stop)
    assert train(resume=str(out))["epoch"] == 2  # the same process, after the first run stopped


def test_default_run_dirs_started_in_the_same_second_do_not_collide(tiny_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(rundir.time, "strftime", lambda fmt: "20250101-120000")
    second = []
    during_first_epoch(monkeypatch, lambda: second.append(train(config(None, seed=2))))
    train(config(None, seed=1))
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["20250101-120000-lenet", "20250101-120000-lenet-2"]
    seeds = {name: json.loads((tmp_path / "runs" / name / "config.json").read_text())["seed"] for name in runs}
    assert sorted(seeds.values()) == [1, 2] and all(saved_epoch(tmp_path / "runs" / n) == 1 for n in runs)


# ----------------------------------------------------------------------------- 2. never over the user's files


@pytest.mark.parametrize("content", ["checkpoint.pt", "notes.txt"])
def test_out_into_a_folder_that_is_not_a_run_is_refused(tiny_data, tmp_path, capsys, content):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / content).write_text("w\n")
    code, _, err = run_cli([*TRAIN, "--out", str(folder)], capsys)
    assert_one_line_error(code, err, f"--out {folder}", "not a gpulab run", content, "choose")
    assert sorted(p.name for p in folder.iterdir()) == [content]
    assert (folder / content).read_text() == "w\n"


def test_out_into_an_empty_folder_is_fine(tiny_data, tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    assert train(config(folder))["epoch"] == 1


# ----------------------------------------------------------------------------- 3. the data it was given


@pytest.mark.parametrize("present", [[], ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"]])
def test_an_explicit_data_dir_without_the_files_is_an_error(tiny_data, tmp_path, capsys, present):
    data_dir = tmp_path / "mine"
    data_dir.mkdir()
    for name in present:
        (data_dir / name).write_bytes((tiny_data / name).read_bytes())
    out = tmp_path / "run"
    code, _, err = run_cli([*TRAIN, "--out", str(out), "--data-dir", str(data_dir)], capsys)
    missing = [s for s in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                           "t10k-labels-idx1-ubyte") if s + ".gz" not in present]
    assert_one_line_error(code, err, f"--data-dir {data_dir}", *missing)
    assert not out.exists()  # $GPULAB_DATA has the data, but it was not asked for


# ----------------------------------------------------------------------------- 4. no dead ends


def test_a_run_that_diverged_in_its_first_epoch_starts_over_in_place(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli([*TRAIN, "--out", str(out), "--lr", "1e6"], capsys)
    assert_one_line_error(code, err, "no checkpoint", "lower --lr")
    assert run_cli([*TRAIN, "--out", str(out)], capsys)[0] == 0
    assert saved_epoch(out) == 1
    assert json.loads((out / "config.json").read_text())["lr"] is None  # the new run's config


def test_a_run_interrupted_before_its_first_checkpoint_starts_over_in_place(tiny_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"

    def interrupt():
        raise KeyboardInterrupt

    during_first_epoch(monkeypatch, interrupt)  # once: the run after it trains
    with pytest.raises(KeyboardInterrupt):
        train(config(out))
    said = capsys.readouterr().out
    assert "--resume" not in said and f"--out {out}" in said  # the way on that works
    with pytest.raises(UserError, match=f"start it over with gpulab train --out {out}"):
        train(resume=str(out))
    assert sorted(p.name for p in out.iterdir()) == [".gpulab.lock", "config.json"]
    assert train(config(out))["epoch"] == 1


def test_a_run_that_failed_at_its_first_step_starts_over_in_place(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "run"

    def fail():
        raise RuntimeError("planted: the first step fails")

    during_first_epoch(monkeypatch, fail)  # once: the run after it trains
    with pytest.raises(RuntimeError, match="planted"):
        train(config(out, devices="cpu*2"))
    assert train(config(out, devices="cpu*2"))["epoch"] == 1


def test_an_allreduce_that_cannot_run_here_is_refused_before_the_run_is_written(tiny_data, tmp_path):
    """--allreduce nccl on CPUs was refused at the first step, the run's folder already written."""
    out = tmp_path / "run"
    with pytest.raises(UserError, match="nccl"):
        train(config(out, devices="cpu*2", allreduce="nccl"))
    assert not out.exists()


def test_sigterm_to_a_lone_run_says_how_to_go_on_as_ctrl_c_does(tiny_data, tmp_path):
    """A scheduler's or `timeout`'s SIGTERM ended a one-process run without a word (exit 143):
    it now stops as Ctrl-C does - the line that says how to go on - and exits 143."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "run"
    gpulab = subprocess.Popen([sys.executable, "-m", "gpulab", "train", "--devices", "cpu", "--epochs", "500",
                               "--batch-size", "32", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    deadline = time.monotonic() + 120
    while not (out / CHECKPOINT).exists():
        assert gpulab.poll() is None and time.monotonic() < deadline, gpulab.communicate()[1][-2000:]
        time.sleep(0.05)
    gpulab.send_signal(signal.SIGTERM)
    stdout, stderr = gpulab.communicate(timeout=60)
    assert gpulab.returncode == 143, stderr[-2000:]
    assert re.search(rf"interrupted after epoch \d+: continue with gpulab train --resume {re.escape(str(out))}", stdout)
    assert stderr.strip().splitlines() == ["gpulab: error: stopped by SIGTERM"]


def test_restarting_in_place_clears_the_old_runs_outputs(tiny_data, tmp_path):
    out = tmp_path / "run"
    train(config(out, epochs=1))
    (out / CHECKPOINT).unlink()  # as if it never finished an epoch, but with stale metrics
    (out / "profile").mkdir()
    train(config(out, epochs=1, seed=3))
    assert json.loads((out / "metrics.json").read_text())[0]["epoch"] == 1
    assert json.loads((out / "config.json").read_text())["seed"] == 3


# ----------------------------------------------------------------------------- 5. no training without samples


def test_no_training_batches_is_an_error(tmp_path):
    empty = torch.utils.data.TensorDataset(torch.zeros(0, 1, 28, 28), torch.zeros(0, dtype=torch.long))
    some = torch.utils.data.TensorDataset(torch.zeros(8, 1, 28, 28), torch.zeros(8, dtype=torch.long))
    out = tmp_path / "run"
    with pytest.raises(UserError, match="no training batches"):
        train(config(out), train_data=torch.utils.data.DataLoader(empty, batch_size=4), test_data=some)
    with pytest.raises(UserError, match="no training batches"):
        train(config(out), train_data=torch.utils.data.DataLoader(some, batch_size=16, drop_last=True), test_data=some)
    with pytest.raises(UserError, match="the test set is empty"):
        train(config(out), train_data=torch.utils.data.DataLoader(some, batch_size=4), test_data=empty)
    assert not out.exists()


def test_an_empty_training_file_is_an_error(make_dataset, tmp_path, capsys):
    data = make_dataset(tmp_path / "zero", num_train=0, num_test=16)
    out = tmp_path / "run"
    code, _, err = run_cli([*TRAIN, "--out", str(out), "--data-dir", str(data)], capsys)
    assert_one_line_error(code, err, "train-images-idx3-ubyte.gz", "no images")
    assert not out.exists()


# ----------------------------------------------------------------------------- 6. one line, never a traceback


@pytest.mark.parametrize("seed", [str(2**70), str(2**62), str(-(2**40))])
def test_a_seed_out_of_range_is_one_line(tiny_data, tmp_path, capsys, seed):
    out = tmp_path / "run"
    code, _, err = run_cli([*TRAIN, "--out", str(out), "--seed", seed], capsys)
    assert_one_line_error(code, err, f"--seed {seed}", "0 to")
    assert not out.exists()


@pytest.mark.parametrize("out", ["/proc/gpulab-x", "/sys/gpulab-x"])
def test_an_out_that_cannot_be_created_is_one_line(tiny_data, capsys, out):
    if not Path(out).parent.is_dir():
        pytest.skip(f"no {Path(out).parent} here")
    code, _, err = run_cli([*TRAIN, "--out", out], capsys)
    assert_one_line_error(code, err, f"--out {out}", "choose another")


def fail_checkpoint_writes(monkeypatch, from_call: int) -> dict:
    """Every checkpoint write from the `from_call`-th on fails as on a full disk, until the
    returned switch's "full" is set to False. (Not monkeypatch.undo(): that would also undo
    tiny_data's $GPULAB_DATA.)"""
    real = rundir.atomic_write_bytes
    calls = []
    switch = {"full": True}

    def write(path, data):
        if Path(path).name == CHECKPOINT and switch["full"]:
            calls.append(path)
            if len(calls) >= from_call:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real(path, data)

    monkeypatch.setattr(rundir, "atomic_write_bytes", write)
    return switch


def test_a_full_disk_while_checkpointing_keeps_the_old_checkpoint(tiny_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    disk = fail_checkpoint_writes(monkeypatch, from_call=2)
    code, _, err = run_cli([*TRAIN, "--epochs", "2", "--out", str(out)], capsys)
    assert_one_line_error(code, err, "No space left on device", "epoch 2", "epoch 1", "intact",
                          f"--resume {out}")
    assert saved_epoch(out) == 1
    assert not list(out.glob(".*.tmp"))
    disk["full"] = False
    assert run_cli(["train", "--resume", str(out)], capsys)[0] == 0
    assert saved_epoch(out) == 2


def test_a_full_disk_at_the_first_checkpoint_says_there_is_none(tiny_data, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    disk = fail_checkpoint_writes(monkeypatch, from_call=1)
    code, _, err = run_cli([*TRAIN, "--out", str(out)], capsys)
    assert_one_line_error(code, err, "No space left on device", "no checkpoint", f"--out {out}")
    disk["full"] = False
    assert run_cli([*TRAIN, "--out", str(out)], capsys)[0] == 0  # starts over in place


@pytest.mark.parametrize("saved, unconfirmed, said", [
    (0, None, "No checkpoint yet in {run}; start over with the same {launcher} command"),
    (2, None, "Last checkpoint: epoch 2, in {run}; continue with {resume}"),
    (2, 3, "Last checkpoint: epoch 2, or 3 if rank 0 finished writing it, in {run}; continue with {resume}"),
    (0, 1, "Rank 0 was writing the first checkpoint (epoch 1): if {run}/checkpoint.pt exists, continue with {resume}; "
           "if not, start over with the same {launcher} command"),
])
@pytest.mark.parametrize("launcher", ["torchrun", "gpulab launch"])
def test_a_rank_s_resume_hint_says_what_it_knows_in_its_launcher_s_words(tmp_path, monkeypatch, saved, unconfirmed,
                                                                          said, launcher):
    """A rank other than 0 learns that rank 0 wrote a checkpoint only at the barrier after it."""
    class TwoRanks:
        world_size = 2

    monkeypatch.setenv(LAUNCHED_BY_GPULAB, "1" if launcher == "gpulab launch" else "0")
    run = tmp_path / "run"
    resume = (f"gpulab launch (the same options) -- --resume {run}" if launcher == "gpulab launch"
              else f"the same torchrun command with gpulab train --resume {run}")
    hint = resume_hint(rundir.RunDir(run), saved, unconfirmed, TwoRanks())
    assert hint == said.format(run=run, launcher=launcher, resume=resume)


@pytest.mark.parametrize("world_size, launcher, after_epoch_2, before_any", [
    (1, "torchrun", "continue with gpulab train --resume {run}",
     "start over with gpulab train --out {run} (and the same options)"),
    (2, "gpulab launch", "continue with gpulab launch (the same options) -- --resume {run}",
     "start over with the same gpulab launch command"),
    (2, "torchrun", "continue with the same torchrun command with gpulab train --resume {run}",
     "start over with the same torchrun command"),
])
def test_ctrl_c_says_how_to_go_on_in_the_launcher_s_words(tmp_path, monkeypatch, world_size, launcher, after_epoch_2,
                                                           before_any):
    """Under gpulab launch, `gpulab train --resume` would go on in one process."""
    class World:
        pass

    world = World()
    world.world_size = world_size
    monkeypatch.setenv(LAUNCHED_BY_GPULAB, "1" if launcher == "gpulab launch" else "0")
    run = tmp_path / "run"
    assert interrupted_line(rundir.RunDir(run), 2, world) == f"interrupted after epoch 2: {after_epoch_2.format(run=run)}"
    assert interrupted_line(rundir.RunDir(run), 0, world) == (f"interrupted before the first checkpoint: "
                                                              f"{before_any.format(run=run)}")


def test_a_run_of_several_devices_in_one_process_resumes_in_one_process(tiny_data, tmp_path):
    """Under torchrun each rank drives one device: the hint is the command that resumes it, not
    --devices auto, which --resume refuses."""
    class TwoRanks:
        world_size = 2

        def share(self, name, read):
            return read()

    out = tmp_path / "run"
    train(config(out, devices="cpu*2"))
    with pytest.raises(UserError, match=rf"this run trained on --devices cpu\*2, several devices in one process, and "
                                        rf"goes on the same way: gpulab train --resume {re.escape(str(out))}$"):
        saved_config(TwoRanks(), rundir.RunDir(out, option="--resume"), None, None)


def test_resuming_with_another_models_checkpoint_is_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    train(config(out, epochs=1))
    saved = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**saved, "model": "resnet18", "epochs": 2}))  # LeNet weights inside
    code, _, err = run_cli(["train", "--resume", str(out)], capsys)
    assert_one_line_error(code, err, f"--resume {out}", CHECKPOINT, "resnet18")
    assert saved_epoch(out) == 1


def test_built_in_images_that_are_not_28x28_are_one_line(tmp_path, capsys):
    import numpy as np

    from gpulab.data.fashion_mnist import FILES
    from gpulab.data.idx import write_idx

    data = tmp_path / "big"
    data.mkdir()
    for part, n in (("train", 64), ("test", 32)):
        write_idx(data / (FILES[f"{part}_images"] + ".gz"), np.zeros((n, 32, 32), np.uint8))
        write_idx(data / (FILES[f"{part}_labels"] + ".gz"), np.zeros(n, np.uint8))
    out = tmp_path / "run"
    code, _, err = run_cli([*TRAIN, "--out", str(out), "--data-dir", str(data)], capsys)
    assert_one_line_error(code, err, "train-images-idx3-ubyte.gz", "32x32", "28x28")
    assert not out.exists()


# ----------------------------------------------------------------------------- 7. resume from anywhere


def test_a_relative_data_dir_is_stored_absolute_and_resume_may_move_it(tiny_data, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("GPULAB_DATA")
    monkeypatch.chdir(tiny_data.parent)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(config(out, epochs=2, data_dir=tiny_data.name), on_epoch_end=stop)
    assert json.loads((out / "config.json").read_text())["data_dir"] == str(tiny_data)

    moved = tmp_path / "moved"
    tiny_data.rename(moved)
    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(["train", "--resume", str(out), "--data-dir", "moved"], capsys)
    assert code == 0, err
    assert saved_epoch(out) == 2
    assert json.loads((out / "config.json").read_text())["data_dir"] == str(moved)


def test_resume_still_refuses_other_options(tiny_data, tmp_path, capsys):
    code, _, err = run_cli(["train", "--resume", str(tmp_path / "run"), "--data-dir", "x", "--batch-size", "3"], capsys)
    assert_one_line_error(code, err, "drop --batch-size")
    assert "--data-dir" not in err.split("drop")[1]


# ----------------------------------------------------------------------------- 8. divergence


class HostReads:
    """Counts reads of tensors to the host (each one waits for the device) while active."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)

            def counted(tensor, *args, _real=real, **kwargs):
                if self.active:
                    self.count += 1
                return _real(tensor, *args, **kwargs)

            monkeypatch.setattr(torch.Tensor, name, counted)


def test_divergence_stops_within_the_epoch_without_a_host_read_per_step(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "CHECK_EVERY", 4)
    reads = HostReads(monkeypatch)
    steps = []
    real_step = Trainer.train_step

    def train_step(self, X, y, meter=None):
        steps.append(1)
        reads.active = True  # from the first step on: the loop's own reads only
        try:
            return real_step(self, X, y, meter)
        finally:
            reads.active = False

    monkeypatch.setattr(Trainer, "train_step", train_step)
    real_epoch = loop.run_epoch
    seen = {}

    def run_epoch(run, epoch, progress=None):
        seen["steps_per_epoch"] = len(run.train_loader)
        reads.active = True
        try:
            return real_epoch(run, epoch, progress)
        finally:
            reads.active = False

    monkeypatch.setattr(loop, "run_epoch", run_epoch)
    with pytest.raises(UserError) as info:
        train(config(tmp_path / "run", lr=1e6))
    assert seen["steps_per_epoch"] == 16
    assert "epoch 1: the training loss became" in str(info.value) and "by step" in str(info.value)
    assert len(steps) < 16  # stopped within the epoch
    assert reads.count <= len(steps) // 4 + 1  # a read every 4 steps, not one per step


def test_reads_stay_one_per_epoch_for_a_healthy_run_of_short_epochs(tiny_data, tmp_path, monkeypatch):
    reads = HostReads(monkeypatch)
    real_epoch = loop.run_epoch

    def run_epoch(run, epoch, progress=None):
        reads.active = True
        try:
            return real_epoch(run, epoch, progress)
        finally:
            reads.active = False

    monkeypatch.setattr(loop, "run_epoch", run_epoch)
    train(config(tmp_path / "run"))
    # 16 steps < CHECK_EVERY: the epoch's one read of the metrics, and on the run's first step the
    # one read of the labels' range (CheckedLoss: out-of-range labels are a device-side assert on CUDA).
    assert reads.count == 2


def blow_up(monkeypatch, epoch: int, key: str, value: float):
    """Epoch `epoch` (1-based) reports `key` = value, as an exploding run would."""
    if key == "test_loss":
        real = loop.evaluate
        calls = []

        def evaluate(run):
            calls.append(1)
            result = real(run)
            return {**result, key: value} if len(calls) == epoch else result

        monkeypatch.setattr(loop, "evaluate", evaluate)
    else:
        real_epoch = loop.run_epoch

        def run_epoch(run, e, progress=None):
            result = real_epoch(run, e, progress)
            return {**result, key: value} if e + 1 == epoch else result

        monkeypatch.setattr(loop, "run_epoch", run_epoch)


@pytest.mark.parametrize("key, value, said", [
    ("train_loss", 41812.0, "the training loss became 4.181e+04"),
    ("test_loss", 6e16, "the test loss became 6e+16"),
    ("test_loss", float("inf"), "the test loss became inf"),
])
def test_an_exploded_epoch_is_not_kept_as_good(tiny_data, tmp_path, monkeypatch, key, value, said):
    out = tmp_path / "run"
    blow_up(monkeypatch, 2, key, value)
    with pytest.raises(UserError) as info:
        train(config(out, epochs=2))
    message = str(info.value)
    assert f"epoch 2: {said}" in message
    assert f"last good checkpoint (epoch 1) kept in {out}" in message
    assert saved_epoch(out) == 1
    assert [r["epoch"] for r in json.loads((out / "metrics.json").read_text())] == [1]


def test_a_first_epoch_with_an_exploded_test_loss_is_not_kept(tiny_data, tmp_path, monkeypatch):
    out = tmp_path / "run"
    blow_up(monkeypatch, 1, "test_loss", 6e16)
    with pytest.raises(UserError, match="epoch 1: the test loss became 6e\\+16.*no checkpoint"):
        train(config(out))
    assert not (out / CHECKPOINT).exists()


def test_the_divergence_rule():
    from gpulab.train.loop import divergence

    first = {"train_loss": 0.8, "test_loss": 0.6}
    assert divergence(first, []) is None
    assert divergence({"train_loss": 0.3, "test_loss": 2.5}, [first]) is None  # overfitting is not divergence
    assert divergence({"train_loss": 81.0, "test_loss": 1.0}, [first]) == (
        "the training loss became 81, over 100x the first epoch's training loss (0.8)")
    assert divergence({"train_loss": 0.3, "test_loss": 81.0}, [first]).startswith("the test loss became 81, over 100x")
    assert divergence({"train_loss": 79.0, "test_loss": 79.0}, [first]) is None  # just under 100 x 0.8
    assert divergence({"train_loss": float("nan"), "test_loss": 1.0}, [first]) == "the training loss became nan"
    assert divergence({"train_loss": 1.0, "test_loss": float("nan")}, []) == "the test loss became nan"
    assert divergence({"train_loss": -5.0, "test_loss": -4.0}, [{"train_loss": -1.0, "test_loss": -1.0}]) is None
    # a fine-tuned regressor whose test targets are noisier than its training targets: no accuracy,
    # a test loss 400x the training loss from the first epoch on, and nothing diverged
    tuned = {"train_loss": 0.0001, "test_loss": 0.04, "train_acc": None}
    assert divergence(tuned, []) is None and divergence({**tuned, "test_loss": 0.043}, [tuned]) is None
    assert divergence({**tuned, "test_loss": 5.0}, [tuned]).startswith("the test loss became 5, over 100x the first "
                                                                       "epoch's losses (0.04)")
    # classes: the first epoch's test loss is judged by its training loss
    assert divergence({"train_loss": 2.0, "test_loss": 6e16, "train_acc": 0.3}, []).startswith("the test loss became 6e+16")


# ----------------------------------------------------------------------------- 9. see test_io.py (fsync)


NAN_WITHIN_EPOCH_JOB = '''
import os, sys, torch
from gpulab.errors import UserError
from gpulab.train import TrainConfig, loop, train
from gpulab.train.step import Trainer

loop.CHECK_EVERY = 2
g = torch.Generator().manual_seed(0)
X, y = torch.randn(256, 1, 28, 28, generator=g), torch.randint(0, 10, (256,), generator=g)
X[5] = float("nan")  # one sample: it lands in one rank's part of one batch
data = torch.utils.data.TensorDataset(X, y)
steps = []
real_step = Trainer.train_step
def train_step(self, *args, **kwargs):
    steps.append(1)
    return real_step(self, *args, **kwargs)
Trainer.train_step = train_step
try:
    train(TrainConfig(devices="cpu", epochs=1, batch_size=16, precision="fp32", out=sys.argv[1]),
          train_data=data, test_data=data)
except UserError as e:
    print(f"rank {os.environ['RANK']} stopped after {len(steps)} of 16 steps: {type(e).__name__} "
          f"printed_by={getattr(e, 'printed_by', None)} {e} <end>", flush=True)
'''


@pytest.mark.slow  # ~11 s: two torchrun processes start
def test_under_torchrun_every_rank_stops_within_the_epoch_at_the_same_step(tmp_path):
    """The flag is summed over the ranks at each read: a NaN on one rank stops all, together."""
    import re
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(NAN_WITHIN_EPOCH_JOB)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
         str(tmp_path / "run")],
        capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    reports = sorted(re.findall(r"rank (\d) stopped after (\d+) of 16 steps: (\w+) printed_by=(\d) (.*?) <end>",
                                result.stdout))
    assert [r[0] for r in reports] == ["0", "1"], result.stdout + result.stderr[-2000:]
    assert reports[0][1] == reports[1][1] and int(reports[0][1]) < 16  # the same step, within the epoch
    assert reports[0][4] == reports[1][4]
    for _, _, kind, printed_by, message in reports:
        assert kind == "SharedError" and printed_by == "0"
        assert "epoch 1: the training loss became nan by step" in message
