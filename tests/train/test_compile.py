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
from gpulab.train.precision import compile_mode
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


def test_auto_records_the_step_only_on_one_gpu_for_gpulabs_own_model():
    cpu, cuda = [torch.device("cpu")], [torch.device("cuda", 0)]  # device objects only: nothing runs on them
    auto = TrainConfig(compile="auto")
    assert compile_mode(auto, cpu) == "off"
    assert compile_mode(auto, cuda) == "record"
    assert compile_mode(TrainConfig(compile="auto", model="resnet18"), cuda) == "record"
    # what a recording cannot hold, or gpulab cannot vouch for: eager
    assert compile_mode(auto, cuda * 2) == "off"
    assert compile_mode(auto, cuda, processes=2) == "off"
    assert compile_mode(TrainConfig(compile="auto", accumulate=2), cuda) == "off"
    assert compile_mode(TrainConfig(compile="auto", model="mine:build"), cuda) == "off"
    assert compile_mode(auto, cuda, own_parts=True) == "off"
    assert compile_mode(TrainConfig(compile="graphs"), cuda) == "graphs"


def test_a_recorded_step_records_the_eager_step_and_compiles_nothing(monkeypatch):
    """record: the Trainer's step is the whole-step recording around the eager forward (StepGraph
    stands in here: a CPU cannot record); graphs: around the compiled forward."""
    from gpulab.models import build
    from gpulab.parallel.data_parallel import DataParallel
    from gpulab.train import step

    monkeypatch.setattr(step, "StepGraph", lambda *args: "recording")
    strategy = DataParallel(build("lenet"), [torch.device("cpu")],
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, fused=True))
    recorded = step.Trainer(strategy, nn.functional.cross_entropy, compile="record")
    assert recorded.graph == "recording" and recorded.forward.compiled is None
    compiled = step.Trainer(strategy, nn.functional.cross_entropy, compile="graphs")
    assert compiled.graph == "recording" and compiled.forward.compile == "on"
    assert step.Trainer(strategy, nn.functional.cross_entropy).graph is None


@pytest.mark.parametrize(("args", "fragments"), [
    (["--compile", "graphs"], ("--compile graphs", "CUDA graphs", "--compile on")),
    (["--compile", "record"], ("--compile record", "CUDA graphs", "--devices cuda")),
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
