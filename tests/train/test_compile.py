"""`gpulab train --compile`: the step through torch.compile trains as the eager step does (parity
against plain PyTorch, within float32's reordering noise; float64 to 1e-9), its compile time is
reported apart from the epochs, auto compiles only runs long enough to win it back, and what
torch cannot do is a one-line refusal. Every strategy compiles: one process here, torchrun ranks
(gpulab's sync, DDP, FSDP2) in the slow tests."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpulab.config import TrainConfig
from gpulab.train import train
from gpulab.train.precision import AUTO_COMPILE, compile_mode
from tests.conftest import assert_one_line_error, run_cli

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_compiled_step_is_parity_with_plain_pytorch(tiny_data, capsys):
    code, out, _ = run_cli(["train", "--compile", "on", "--batch-size", "32", "--check-parity"], capsys)
    assert code == 0, out
    assert "parity PASS" in out
    f32, noise = map(float, re.search(r"float32 ([\d.e+-]+) is within 10x what reordering the samples alone changes "
                                      r"\(([\d.e+-]+)\)", out).groups())
    assert f32 <= 10 * noise


def test_compile_time_is_reported_apart_from_the_epoch(tmp_path, capsys):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(512, 16, generator=g)
    y = (X @ torch.randn(16, 3, generator=g)).argmax(1)
    data = TensorDataset(X, y)
    cfg = TrainConfig(epochs=2, batch_size=64, compile="on", precision="fp32", out=str(tmp_path / "run"))
    train(cfg, train_data=data, test_data=data, model=nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3)),
          loss_fn=nn.CrossEntropyLoss())
    rows = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert rows[0]["compile_seconds"] > 0 and rows[1]["compile_seconds"] == 0  # compiled once, in epoch 1
    out = capsys.readouterr().out
    assert "torch.compile" in out and re.search(r"epoch  1/2 .* \(\+ [\d.]+ s compiling\)", out)


def test_auto_is_what_was_measured():
    cpu, cuda = [torch.device("cpu")], [torch.device("cuda", 0)]
    assert compile_mode(TrainConfig(compile="auto"), cpu) == AUTO_COMPILE == "off"
    assert compile_mode(TrainConfig(compile="auto"), cuda) == "off"  # not measured on a GPU yet
    assert compile_mode(TrainConfig(compile="graphs"), cuda) == "graphs"


@pytest.mark.parametrize(("args", "fragments"), [
    (["--compile", "graphs"], ("--compile graphs", "CUDA graphs", "--compile on")),
    (["--compile", "on", "--devices", "cpu*2", "--sync-bn"], ("--compile with --sync-bn", "threads")),
])
def test_what_torch_compile_cannot_do_is_refused_in_one_line(tiny_data, capsys, args, fragments):
    code, _, err = run_cli(["train", *args, "--epochs", "1", "--batch-size", "32"], capsys)
    assert_one_line_error(code, err, *fragments)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [[], ["--sync", "ddp"], ["--shard", "fsdp"]])
def test_compiled_torchrun_ranks_are_parity_with_plain_pytorch(tiny_data, tmp_path, strategy):
    done = subprocess.run([sys.executable, "-m", "gpulab", "launch", "-n", "2", "--", "--compile", "on",
                           "--batch-size", "32", "--check-parity", *strategy], capture_output=True, text=True,
                          timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "parity PASS" in done.stdout and "within 10x what reordering" in done.stdout
