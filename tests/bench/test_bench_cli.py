"""`gpulab bench` end to end: every benchmark runs on tiny sizes and leaves a table, JSON and PNG."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout

import pytest
import torch

from gpulab import bench
from gpulab.cli import main
from tests.conftest import assert_one_line_error, disk_full_for, run_cli

ENV_KEYS = {"date", "torch", "torch_cuda_build", "driver", "gpus", "cpu", "torch_threads", "python", "cpu_busy_pct"}
TIMING_KEYS = {"median_s", "iqr_s", "min_s", "max_s", "repeats", "inner", "clock"}


def _timings(rows):
    for row in rows:
        for value in row.values():
            if isinstance(value, dict) and "median_s" in value:
                yield value


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """`gpulab bench all --preset tiny`, once for the module (it takes a few seconds)."""
    # pytest registers tests/conftest.py as `tests.conftest`; its fixtures are per test, so the
    # module-wide run calls the dataset writer directly.
    from tests.conftest import make_idx_dataset

    out = tmp_path_factory.mktemp("bench")
    data = make_idx_dataset(tmp_path_factory.mktemp("fashion"))
    buf = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, redirect_stdout(buf):
        mp.setenv("GPULAB_DATA", str(data))  # the test must not depend on the real dataset
        code = main(["bench", "all", "--preset", "tiny", "--out", str(out)])
    return code, out, buf.getvalue()


def test_all_tiny_writes_json_and_png_per_benchmark(tiny_run):
    code, out, text = tiny_run
    assert code == 0, text
    for name in bench.BENCHMARKS:
        data = json.loads((out / f"{name}.json").read_text())
        assert data["benchmark"] == name and data["status"] == "ok" and data["preset"] == "tiny"
        assert ENV_KEYS <= set(data["env"]), name
        assert data["summary"]["headline"], name
        assert data["checks"] and all(c["passed"] for c in data["checks"]), name
        rows = [r for t in data["tables"].values() for r in t["rows"]]
        assert rows, name
        timings = list(_timings(rows))
        assert timings, name
        for t in timings:
            assert TIMING_KEYS <= set(t) and t["min_s"] <= t["median_s"] <= t["max_s"], name
        png = (out / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n", name


def test_all_tiny_prints_tables_and_summary(tiny_run):
    code, out, text = tiny_run
    for name in bench.BENCHMARKS:
        assert f" {name} " in text  # the rule heading each benchmark
    assert "gpulab bench:" in text  # the summary table
    assert "checked" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only output")
def test_cpu_only_says_which_rows_were_skipped_and_why(tiny_run):
    code, out, text = tiny_run
    for name in bench.BENCHMARKS:
        skipped = json.loads((out / f"{name}.json").read_text())["skipped"]
        assert any("GPU" in s["what"] and s["why"] for s in skipped), name
    assert "skipped" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="without GPUs only: with them the devices are real")
def test_multi_device_benchmarks_say_replicas_share_cores(tiny_run):
    code, out, text = tiny_run
    for name in ("concurrency", "allreduce", "scaling"):
        notes = " ".join(json.loads((out / f"{name}.json").read_text())["notes"])
        assert "same cores" in notes, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_scaling_on_gpus_says_what_it_measured(tiny_run):
    code, out, text = tiny_run
    notes = " ".join(json.loads((out / "scaling.json").read_text())["notes"])
    assert "same cores" not in notes  # GPUs are separate devices, not replicas on shared cores
    if torch.cuda.device_count() == 1:
        assert "only one device (cuda:0)" in notes


def test_busbw_follows_the_ring_formula(tiny_run):
    code, out, text = tiny_run
    rows = json.loads((out / "allreduce.json").read_text())["tables"]["sweep"]["rows"]
    assert {r["algorithm"] for r in rows} >= {"naive", "ring", "gloo"}
    for r in rows:
        k = r["k"]
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["time"]["median_s"] / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * 2 * (k - 1) / k)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "nope"], "unknown benchmark 'nope'"),
        (["bench", "matmul", "--devices", "tpu"], "unknown device 'tpu'"),
        (["bench", "matmul", "--devices", "cuda:7"], "not available"),
        (["bench", "matmul", "vectorize", "--rounds", "1"], "--rounds: matmul, vectorize run no rounds (training does)"),
        (["bench", "training", "--rounds", "0"], "--rounds 0: must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_out_that_is_a_file_is_a_user_error(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["bench", "matmul", "--preset", "tiny", "--out", str(f)]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_full_disk_is_one_line_and_leaves_no_partial_file(tmp_path, monkeypatch, capsys):
    disk_full_for(monkeypatch, "matmul.json")
    code, _, err = run_cli(["bench", "matmul", "--preset", "tiny", "--out", str(tmp_path)], capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / 'matmul.json'}: No space left on device; "
                                     f"free space or use --out DIR")
    assert list(tmp_path.iterdir()) == []


def test_a_failed_equality_check_fails_the_run(tmp_path, monkeypatch, capsys):
    from gpulab.bench import vectorize

    real = vectorize.one_hot_ways

    def broken(seg, classes):
        ways = real(seg, classes)
        ways["broadcast: seg == arange"] = lambda: ~real(seg, classes)["loop over classes"]()
        return ways

    monkeypatch.setattr(vectorize, "one_hot_ways", broken)
    assert main(["bench", "vectorize", "--preset", "tiny", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out
    data = json.loads((tmp_path / "vectorize.json").read_text())
    assert data["status"] == "failed" and "differ" in data["error"]
    assert data["checks"][-1]["passed"] is False and data["checks"][-1]["max_abs_diff"] == 1.0
    assert (tmp_path / "vectorize.png").exists()


def test_devices_flag_selects_virtual_replicas(tmp_path, capsys):
    assert main(["bench", "allreduce", "scaling", "--preset", "tiny", "--devices", "cpu*3", "--out", str(tmp_path)]) == 0
    sweep = json.loads((tmp_path / "allreduce.json").read_text())["tables"]["sweep"]["rows"]
    assert {r["k"] for r in sweep} == {2, 3}
    steps = json.loads((tmp_path / "scaling.json").read_text())["tables"]["steps"]["rows"]
    assert [r["k"] for r in steps] == [1, 2, 3]
    assert json.loads((tmp_path / "scaling.json").read_text())["command"].startswith("gpulab bench allreduce scaling")


@pytest.mark.parametrize("flags, preset", [([], "full"), (["--quick"], "quick"), (["--preset", "tiny"], "tiny")])
def test_preset_flags(flags, preset):
    from gpulab.cli import build_parser

    assert build_parser().parse_args(["bench", "matmul", *flags]).preset == preset


def test_rounds_sets_the_rounds_of_a_benchmark_that_runs_them(monkeypatch, tmp_path):
    """--rounds 1 for training, on top of any preset; benchmarks without rounds keep their sizes."""
    from gpulab import bench
    from gpulab.bench import training

    seen = {}

    def fake_run(cfg, ctx, result):
        seen[result.name] = cfg

    monkeypatch.setattr(training, "run", fake_run)
    assert main(["bench", "training", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert seen["training"] == training.Config(rounds=1)  # the full preset's 10 epochs, one round
    assert json.loads((tmp_path / "training.json").read_text())["command"].endswith(f"--rounds 1 --out {tmp_path}")
    assert bench.config(training, "tiny", rounds=2) == training.Config(**{**training.PRESETS["tiny"], "rounds": 2})
    matmul = bench.load("matmul")
    assert bench.config(matmul, "tiny", rounds=5) == bench.config(matmul, "tiny")


@pytest.mark.slow
def test_all_quick(tmp_path, tiny_data):
    """The acceptance command itself: `gpulab bench all --quick` (about 1-2 minutes on 2 cores)."""
    assert main(["bench", "all", "--quick", "--out", str(tmp_path)]) == 0
    for name in bench.BENCHMARKS:
        assert (tmp_path / f"{name}.json").exists() and (tmp_path / f"{name}.png").exists()
