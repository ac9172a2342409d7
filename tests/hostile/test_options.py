"""Hostile option values: absurd device counts, learning rates past float32, non-finite profiler
settings, markup in a script's name. Each is one line on stderr, a non-zero exit, nothing written
(or, for a name, the outputs drawn as usual)."""

from __future__ import annotations

import sys

import pytest

from gpulab import devices
from gpulab.errors import UserError
from gpulab.monitor.config import ProfileConfig
from tests.conftest import assert_one_line_error, run_cli as run

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRAIN = ["train", "--epochs", "1", "--batch-size", "64"]


def test_virtual_replica_counts_past_the_cap_are_one_line(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    # 20 digits overflowed the list of devices; 100000 replicas would each copy the model.
    for count in ("99999999999999999999", "100000", str(devices.MAX_VIRTUAL_REPLICAS + 1), "9" * 5000):
        code, stdout, err = run([*TRAIN, "--out", str(out), "--devices", f"cpu*{count}"], capsys)
        assert_one_line_error(code, err, f"asks for {count} virtual replicas",
                              f"at most {devices.MAX_VIRTUAL_REPLICAS}")
        assert not out.exists() and stdout == ""
    assert devices.resolve(f"cpu*{devices.MAX_VIRTUAL_REPLICAS}") == [devices.cpu()] * devices.MAX_VIRTUAL_REPLICAS


@pytest.mark.parametrize("args", [["--lr", "1e39"], ["--lr", "2e38", "--scale-batch", "--devices", "cpu*2"]])
def test_a_learning_rate_past_float32_is_one_line(tiny_data, tmp_path, capsys, args):
    """The optimizer converts the learning rate to float32; past its largest number that failed
    inside torch's SGD on the first step."""
    out = tmp_path / "run"
    code, stdout, err = run([*TRAIN, "--devices", "cpu", "--out", str(out), *args], capsys)
    assert_one_line_error(code, err, "--lr", "float32")
    assert not out.exists() and stdout == ""


@pytest.mark.parametrize("args", [["--hang-after", "nan"], ["--hang-after", "inf"], ["--hang-after", "-1"],
                                  ["--interval", "nan"], ["--interval", "inf"]])
def test_profiler_numbers_that_are_not_finite_and_positive_are_one_line(tmp_path, capsys, args):
    script = tmp_path / "script.py"
    script.write_text("print('ran')\n")
    out = tmp_path / "prof"
    code, stdout, err = run(["profile", *args, "--out", str(out), "--", sys.executable, str(script)], capsys)
    assert_one_line_error(code, err, args[0])
    assert not out.exists() and "ran" not in stdout
    # The same settings from Python: counts are whole numbers, not nan.
    with pytest.raises(UserError, match="warmup_steps nan"):
        ProfileConfig(warmup_steps=float("nan"))


def test_markup_in_a_script_name_is_drawn_as_written(tmp_path, capfd):
    """matplotlib reads $...$ as TeX: `\\foo` is no TeX symbol, the timeline failed to render and
    the script's exit code 0 became 1."""
    script = tmp_path / "run$\\foo$.py"
    script.write_text("print('ran')\n")  # no torch: the profiler still writes its outputs, quickly
    out = tmp_path / "prof"
    from gpulab.cli import main

    code = main(["profile", "--out", str(out), "--", sys.executable, str(script)])
    captured = capfd.readouterr()
    assert code == 0, captured.err
    assert "ran" in captured.out and "Traceback" not in captured.err
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
