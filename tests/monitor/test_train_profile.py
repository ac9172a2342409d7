"""`gpulab train --profile`: gpulab's own trainer under the same machinery, outputs in the run dir."""

from __future__ import annotations

import json

from rich.console import Console

from gpulab.cli import main
from gpulab.train import TrainConfig, train
from tests.monitor.reports import read_report


def test_train_profile_writes_the_profile_into_the_run_directory(tiny_data, tmp_path):
    run = tmp_path / "run"
    console = Console(file=open(tmp_path / "console.txt", "w"), width=200)
    train(TrainConfig(epochs=1, batch_size=64, devices="cpu", out=str(run), profile=True), console=console)
    console.file.close()
    report = read_report(run / "profile")
    assert report["steps"] == 8  # 512 training samples / batch 64
    assert report["findings"] and report["phases"]["compute"] > 0
    trace = json.loads((run / "profile" / "trace.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"data", "scatter", "forward_backward", "optimizer"} <= names  # the trainer's PhaseTimer phases
    assert (run / "profile" / "timeline.png").is_file()
    assert "gpulab profile: 8 steps" in (tmp_path / "console.txt").read_text()
    assert (run / "metrics.json").is_file()  # the run itself is unchanged


def test_train_without_profile_writes_no_profile(tiny_data, tmp_path):
    run = tmp_path / "run"
    assert main(["train", "--epochs", "1", "--batch-size", "256", "--devices", "cpu", "--out", str(run)]) == 0
    assert not (run / "profile").exists()


def test_a_run_started_over_in_place_drops_its_predecessors_profile(tiny_data, tmp_path):
    """A run stopped before its first checkpoint starts over with the same --out; the report of the
    one before, with its batch size, would read as this run's. What gpulab did not write stays."""
    run = tmp_path / "run"
    argv = ["train", "--epochs", "1", "--batch-size", "256", "--devices", "cpu", "--out", str(run)]
    assert main([*argv, "--profile"]) == 0
    (run / "checkpoint.pt").unlink()  # as if stopped before its first checkpoint
    assert main(argv) == 0
    assert not (run / "profile").exists()

    (run / "checkpoint.pt").unlink()
    assert main([*argv, "--profile"]) == 0
    (run / "checkpoint.pt").unlink()
    (run / "profile" / "notes.txt").write_text("mine")
    assert main(argv) == 0
    assert [p.name for p in (run / "profile").iterdir()] == ["notes.txt"]
