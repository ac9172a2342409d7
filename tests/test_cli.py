"""The command line: bad input is one line on stderr, exit 2, and nothing written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import assert_one_line_error, run_cli as run
from gpulab import __version__
from gpulab.train import TrainConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")


TRAIN = ["train", "--devices", "cpu", "--epochs", "1", "--batch-size", "32"]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--model", "vgg"], ["--model vgg", "unknown model", "lenet"]),
        (["--model", "../models:net"], ["--model ../models:net", "import names, not a file path"]),
        (["--model", "custom"], ["--model custom", "passed to train() as an object", "package.module:factory"]),
        (["--data", "cifar10"], ["--data cifar10", "choose one of fashion-mnist"]),
        (["--devices", "tpu"], ["unknown device 'tpu'", "available: cpu"]),
        (["--devices", "cpu*0"], ["cpu*K with K >= 1"]),
        (["--devices", "cpu,cpu"], ["lists a device twice"]),
        (["--devices", "cpu*2,cpu"], ["puts cpu*K in a list: cpu*K stands alone"]),
        (["--seed", "-1"], ["--seed -1: out of range; use a whole number from 0 to"]),
        (["--batch-size", "0"], ["--batch-size 0"]),
        (["--batch-size", "-3"], ["--batch-size -3"]),
        (["--devices", "cpu*4", "--batch-size", "2"], ["smaller than the 4 devices"]),
        (["--lr", "0"], ["--lr 0.0", "positive"]),
        (["--lr", "-0.5"], ["--lr -0.5", "positive"]),
        (["--lr", "nan"], ["--lr nan", "positive"]),
        (["--epochs", "0"], ["--epochs 0", "at least 1"]),
        (["--epochs", "two"], ["--epochs", "invalid int value"]),
        (["--eval-batch-size", "0"], ["--eval-batch-size 0"]),
        (["--recipe", "textbook", "--model", "resnet18"], ["use --model lenet"]),
        (["--recipe", "fast"], ["--recipe fast", "choose one of modern, textbook"]),
        (["--frobnicate"], ["unrecognized arguments: --frobnicate"]),
    ],
)
def test_train_bad_input(tiny_data, tmp_path, capsys, args, fragments):
    out = tmp_path / "run"
    code, stdout, err = run([*TRAIN, "--out", str(out), *args], capsys)
    assert_one_line_error(code, err, *fragments)
    assert not out.exists()
    assert stdout == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without GPUs")
def test_train_options_are_the_config_fields_with_their_types():
    from gpulab.cli import build_parser
    from gpulab.options import given_options, train_fields

    args = build_parser().parse_args(["train", "--batch-size", "64", "--lr", "0.05", "--sync-bn", "--precision", "bf16",
                                      "--data-dir", "d", "--timeout", "5"])
    given = given_options(args, train_fields())
    assert given == {"batch_size": 64, "lr": 0.05, "sync_bn": True, "precision": "bf16", "data_dir": "d", "timeout": 5.0}
    assert type(given["timeout"]) is float and type(given["batch_size"]) is int
    cfg = TrainConfig(**given)
    assert (cfg.batch_size, cfg.lr, cfg.sync_bn, cfg.epochs) == (64, 0.05, True, 10)  # the rest: TrainConfig's defaults


def test_every_recipe_name_is_a_choice_of_recipe():
    import typing

    from gpulab.config import RECIPES, RecipeName

    assert set(typing.get_args(RecipeName)) == set(RECIPES)


def test_train_unavailable_gpu(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run([*TRAIN, "--out", str(out), "--devices", "cuda:0"], capsys)
    assert_one_line_error(code, err, "'cuda:0' is not available", "available: cpu")
    assert not out.exists()


def test_train_missing_data_dir(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run([*TRAIN, "--out", str(out), "--data-dir", str(tmp_path / "nope")], capsys)
    assert_one_line_error(code, err, "--data-dir", "does not exist")
    assert not out.exists()


def test_train_corrupted_data(tiny_data, tmp_path, capsys):
    (tiny_data / "t10k-labels-idx1-ubyte.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 30)
    out = tmp_path / "run"
    code, _, err = run([*TRAIN, "--out", str(out)], capsys)
    assert_one_line_error(code, err, "t10k-labels-idx1-ubyte.gz", "corrupted gzip")
    assert not out.exists()


def test_train_out_under_a_file(tiny_data, tmp_path, capsys):
    a_file = tmp_path / "somefile"
    a_file.write_text("not a folder")
    for out in (a_file / "run", a_file):
        code, _, err = run([*TRAIN, "--out", str(out)], capsys)
        assert_one_line_error(code, err, f"--out {out}", "choose")
    assert a_file.read_text() == "not a folder"


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="no sysfs")
def test_train_out_where_even_root_cannot_create_a_folder(capsys):
    """os.access says yes to root in /sys; making a folder there fails all the same."""
    code, _, err = run([*TRAIN, "--out", "/sys/kernel/run"], capsys)
    assert_one_line_error(code, err, "/sys/kernel is not writable")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders anyway")
def test_train_out_in_a_read_only_folder(tiny_data, tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        code, _, err = run([*TRAIN, "--out", str(locked / "run")], capsys)
        assert_one_line_error(code, err, "is not writable")
        assert not (locked / "run").exists()
    finally:
        locked.chmod(0o700)


@pytest.fixture
def no_data(tmp_path, monkeypatch):
    """No Fashion-MNIST anywhere, and any download attempt fails the test."""
    from gpulab.data import fashion_mnist

    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("GPULAB_DATA", str(empty))
    monkeypatch.setenv("XDG_CACHE_HOME", str(empty))
    monkeypatch.setattr(fashion_mnist, "DEBIAN_DIR", empty)

    def no_download(target):
        raise AssertionError(f"tried to download into {target}")

    monkeypatch.setattr(fashion_mnist, "_download", no_download)


@pytest.mark.parametrize("options, words", [
    (["--sync", "ddp"], "--sync ddp: for torchrun ranks, and this is one process"),
    (["--backend", "gloo"], "--backend gloo: for torchrun ranks"),
    (["--timeout", "30"], "--timeout 30: for torchrun ranks"),
    (["--check-parity", "--out", "x", "--epochs", "3"], "--check-parity checks a few steps against plain PyTorch and "
                                                        "writes no run: drop --out, --epochs"),
])
def test_options_that_would_do_nothing_here_are_refused_not_recorded(tiny_data, tmp_path, capsys, monkeypatch, options,
                                                                      words):
    """In one process --sync ddp was accepted and written to config.json as if it had acted."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["train", "--devices", "cpu", "--epochs", "1", *options], capsys)
    assert_one_line_error(code, err, words)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "x").exists()


def test_resume_of_an_empty_path_is_refused_not_a_new_run(tmp_path, capsys, monkeypatch):
    """`--resume "$RUN"` with RUN never set trained a new 10-epoch run into runs/."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(["train", "--resume", ""], capsys)
    assert_one_line_error(code, err, "--resume '': an empty path; give the run directory to continue")
    assert not (tmp_path / "runs").exists()


def test_resume_of_a_dir_without_checkpoint(no_data, tmp_path, capsys):
    """Says so before loading (let alone downloading) any data."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(TrainConfig(devices="cpu", out=str(run_dir)).to_dict()))
    (run_dir / ".gpulab.lock").write_text("pid 1 on host\n")  # a run gpulab made, stopped before its first epoch
    code, stdout, err = run(["train", "--resume", str(run_dir)], capsys)
    assert_one_line_error(code, err, f"--resume {run_dir}", "no checkpoint.pt")
    assert sorted(p.name for p in run_dir.iterdir()) == [".gpulab.lock", "config.json"]


@pytest.mark.parametrize("exists", [True, False])
def test_resume_of_a_dir_that_is_not_a_run(tiny_data, tmp_path, capsys, exists):
    run_dir = tmp_path / "run"
    if exists:
        run_dir.mkdir()
    code, _, err = run(["train", "--resume", str(run_dir)], capsys)
    assert_one_line_error(code, err, "no readable config.json")
    assert run_dir.exists() == exists
    if exists:
        assert not list(run_dir.iterdir())


def test_resume_with_other_options(tiny_data, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, _, err = run(["train", "--resume", str(run_dir), "--lr", "5", "--sync-bn"], capsys)
    assert_one_line_error(code, err, "drop --lr, --sync-bn")
    assert not run_dir.exists()


def test_resume_refuses_another_model_and_a_parity_check(tiny_data, tmp_path, capsys):
    """Both were dropped without a word: a finished LeNet run said "complete" to --model resnet18."""
    run_dir = tmp_path / "run"
    code, _, err = run([*TRAIN, "--out", str(run_dir)], capsys)
    assert code == 0, err
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    code, _, err = run(["train", "--resume", str(run_dir), "--model", "resnet18"], capsys)
    assert_one_line_error(code, err, "--model resnet18, but this run trains lenet (its config.json), and a run keeps "
                                     "its model: drop --model")
    code, _, err = run(["train", "--resume", str(run_dir), "--check-parity"], capsys)
    assert_one_line_error(code, err, "--check-parity checks a run's settings before it trains, not a run to continue")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()} == before


def test_nan_loss_stops_with_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run([*TRAIN, "--epochs", "2", "--lr", "1e6", "--out", str(out)], capsys)
    assert_one_line_error(code, err, "epoch 1: the training loss became", "lower --lr", "no checkpoint")
    assert not (out / "checkpoint.pt").exists()


def test_train_on_two_virtual_cpus(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run([*TRAIN, "--devices", "cpu*2", "--epochs", "2", "--out", str(out)], capsys)
    assert code == 0, err
    assert "training lenet on [cpu*2]" in stdout
    assert "test acc:" in stdout
    rows = json.loads((out / "metrics.json").read_text())
    assert [r["epoch"] for r in rows] == [1, 2]
    assert json.loads((out / "config.json").read_text())["devices"] == "cpu*2"


def test_sync_bn_on_a_model_without_batchnorm_says_so(tiny_data, tmp_path, capsys):
    code, stdout, err = run([*TRAIN, "--devices", "cpu*2", "--sync-bn", "--out", str(tmp_path / "run")], capsys)
    assert code == 0, err
    assert "--sync-bn has no effect here: this model has no BatchNorm layers" in stdout


def test_train_then_resume_with_more_epochs(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    assert run([*TRAIN, "--out", str(out)], capsys)[0] == 0
    code, stdout, _ = run(["train", "--resume", str(out)], capsys)
    assert code == 0 and "is complete: 1 of 1 epochs trained" in stdout
    code, stdout, err = run(["train", "--resume", str(out), "--epochs", "2"], capsys)
    assert code == 0, err
    assert "extending from epoch 1 to 2: the learning rate follows a 2-epoch onecycle schedule" in stdout
    assert "epoch  2/2" in stdout and "test acc:" in stdout
    assert [r["epoch"] for r in json.loads((out / "metrics.json").read_text())] == [1, 2]
    # The same total again is no extension: the run is complete, and nothing is said of extending.
    code, stdout, _ = run(["train", "--resume", str(out), "--epochs", "2"], capsys)
    assert code == 0 and "is complete: 2 of 2 epochs trained" in stdout and "extending" not in stdout


def test_devices(capsys):
    code, out, err = run(["devices"], capsys)
    assert code == 0 and err == ""
    assert f"torch {torch.__version__}" in out
    if not torch.cuda.is_available():
        assert "no GPU found" in out
    assert "cpu" in out


def test_devices_json(capsys):
    code, out, _ = run(["devices", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["torch"] == torch.__version__
    assert report["torch_sees_gpus"] == torch.cuda.device_count()
    assert report["cpu"]["logical_cores"] >= 1
    if not torch.cuda.is_available():
        assert report["torch_sees_gpus"] == 0
        if report["gpus"]:  # NVIDIA GPUs this torch cannot use: an error, with the wheel to install
            assert report["verdict"]["status"] == "error" and report["verdict"]["fix"]
        else:  # no driver: no GPU; NVML unreadable: a warning that says why
            assert report["verdict"]["status"] in ("no_gpu", "warning")


def test_no_command(capsys):
    code, _, err = run([], capsys)
    assert_one_line_error(code, err, "required")


def test_version(capsys):
    code, out, _ = run(["--version"], capsys)
    assert code == 0 and out.strip() == f"gpulab {__version__}"


def test_a_missing_dependency_is_one_line_naming_the_package(tmp_path):
    # From a checkout (PYTHONPATH=src) on a Python that lacks rich: one line, not a traceback.
    code = ("import sys, runpy; sys.modules['rich'] = None; sys.argv = ['gpulab', 'devices']; "
            "runpy.run_module('gpulab', run_name='__main__')")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip() == ("gpulab: error: this Python lacks rich, which gpulab needs: pip install rich "
                                   "(or install gpulab itself: pip install -e .)")


LEAVING = """
import atexit, sys, threading, time
from gpulab.cli import leave

class Finalized:
    def __del__(self):
        print("torn down", flush=True)

KEPT = Finalized()  # freed only by the interpreter's teardown
atexit.register(lambda: print("exit handler ran", flush=True))
print("buffered, not flushed")  # a pipe: block-buffered
if sys.argv[1] == "thread":
    threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
leave(0 if sys.argv[1] == "torchrun, ok" else 3)
"""


@pytest.mark.parametrize("case", ["alone", "thread", "torchrun, failed", "torchrun, ok"])
def test_the_command_leaves_after_its_exit_handlers_without_the_interpreters_teardown(case):
    """`gpulab` (console script, python -m gpulab) ends with leave(): the exit code, the exit
    handlers and what stdout holds, as at any exit; the teardown (torch's takes 0.4-0.8 s) skipped -
    unless a thread Python would wait for is alive, or a rank under torchrun failed: then the
    ordinary exit (which waits for the thread; and gives the rank that says why its time)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    env.pop("TORCHELASTIC_ERROR_FILE", None)
    if case.startswith("torchrun"):
        env["TORCHELASTIC_ERROR_FILE"] = os.devnull
    done = subprocess.run([sys.executable, "-c", LEAVING, case], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == (0 if case == "torchrun, ok" else 3), done.stderr
    assert "buffered, not flushed" in done.stdout and "exit handler ran" in done.stdout
    if case in ("alone", "torchrun, ok"):
        assert "torn down" not in done.stdout
    else:
        assert "torn down" in done.stdout
    if case == "thread":
        assert done.stdout.index("thread done") < done.stdout.index("exit handler ran")


@pytest.mark.parametrize("stdout", ["full disk", "closed"])
def test_output_that_cannot_be_printed_is_one_line_not_a_traceback(stdout):
    """gpulab devices > /dev/full: one line, exit 1; gpulab devices >&- (no stdout at all): the
    work is done, nothing to say, exit 0."""
    command = [sys.executable, "-m", "gpulab", "devices", "--json"]
    if stdout == "full disk":
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
        assert done.returncode == 1 and done.stderr.startswith("gpulab: error: could not print the results: No space")
    else:
        done = subprocess.run(command, stderr=subprocess.PIPE, text=True, timeout=120, preexec_fn=lambda: os.close(1))
        assert done.returncode == 0
    assert done.stderr.count("\n") <= 1 and "Traceback" not in done.stderr, done.stderr
