"""torch.compile as a profile cause (issue 35): the planted scripts' compile time split out of
the steady steps, the recompile named with its guard failure, line and fix, the graph break with
its reason, line and fix - each against what the script measures of itself. An eager script gets
no compile report (test_profile_safety.py); the CUDA graph skip is in test_gpu.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gpulab.monitor.analyze.compiled import compile_summary, compiles_line
from gpulab.monitor.events import Recording
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"


def profile(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "prof"
    done = subprocess.run([sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--", sys.executable,
                           str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, read_report(out)


def planted(script: str) -> str:
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if '# planted:' in line)}"


def truth(stdout: str) -> dict[str, str]:
    words = next(line for line in stdout.splitlines() if line.startswith("TRUTH ")).split()[1:]
    return dict(zip(words[0::2], words[1::2]))


def by_cause(report: dict, cause: str) -> list[dict]:
    return [f for f in report["findings"] if f["cause"] == cause]


def test_a_changing_batch_size_is_a_recompile_at_its_line_and_compiling_is_apart_from_the_steps(tmp_path):
    done, report = profile(tmp_path, "compile_recompile.py")
    told = truth(done.stdout)
    compiled = report["compile"]
    # the script's own clock: the steps that met a new size, compile and all
    assert 0.5 * float(told["first_calls_s"]) <= compiled["seconds"] <= float(told["first_calls_s"]) * 1.05 + 0.1
    assert report["excluded_steps"]["compiling"] >= 2  # the compiling steps are not steady steps
    assert report["step_time_s"]["median"] < 10 * float(told["median_step_ms"]) / 1e3
    (recompile,) = by_cause(report, "recompile")
    assert recompile["where"].endswith(planted("compile_recompile.py"))
    assert "size mismatch at index 0" in recompile["evidence"] and "mark_dynamic(x, 0)" in recompile["fix"]
    (spent,) = by_cause(report, "compile_time")
    assert spent["share"] >= 0.1 and spent["where"].endswith(planted("compile_recompile.py"))
    # the count is torch's: frames compiled (a backward compiled lazily is counted apart)
    assert compiled["compiles"] == int(told["frames_compiled"])
    assert f"{told['frames_compiled']} frames compiled" in spent["evidence"]


def test_an_item_in_forward_is_a_graph_break_at_its_line_with_the_fix(tmp_path):
    done, report = profile(tmp_path, "compile_graph_break.py")
    (broke,) = by_cause(report, "graph_break")
    assert broke["where"].endswith(truth(done.stdout)["graph_break_line"]) and "Tensor.item()" in broke["evidence"]
    assert "keep the value on the device" in broke["fix"]
    assert "[__graph_breaks]" not in done.stderr and "[__recompiles]" not in done.stderr  # gpulab's reading is silent
    # torch compiled the same frames and broke the same graphs as it does without the profiler
    told = truth(done.stdout)
    assert report["compile"]["compiles"] == int(told["frames_compiled"])
    assert sum(g["count"] for g in report["compile"]["graph_breaks"]) == int(told["graph_breaks"])


def test_gpulab_train_compiled_and_profiled_runs_and_its_compiles_are_apart(tmp_path, tiny_data):
    # gpulab train imports gpulab.compiler, which imports torch._dynamo: the probe's hook on that
    # import finds gpulab.compiler half-executed (it once failed the run with an ImportError)
    out = tmp_path / "prof"
    done = subprocess.run([sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--", sys.executable, "-m",
                           "gpulab", "train", "--devices", "cpu", "--epochs", "1", "--compile", "on",
                           "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = read_report(out)
    told = json.loads((tmp_path / "run" / "metrics.json").read_text())[-1]["compile_seconds"]
    # gpulab train's own compile clock and the profile's read the same compiles
    assert report["compile"]["compiles"] >= 1 and report["compile"]["backward_compiles"] >= 1
    assert abs(report["compile"]["seconds"] - told) <= 0.1 * told + 0.05
    assert report["excluded_steps"]["compiling"] >= 1


def test_the_counts_are_torchs_a_backward_and_a_cuda_graph_recording_apart_from_the_frames():
    """compiles = frames dynamo compiled (recompiles included), as torch.compile counts them; the
    lazy compile of a backward and a CUDA graph recording are compiles of another kind."""
    def compile(compile_id: str, trigger: str, t0: float) -> dict:
        return {"type": "compile", "kind": "compile", "t0": t0, "t1": t0 + 1.0, "compile_id": compile_id,
                "trigger": trigger, "function": None, "where": "train.py:9", "reason": None, "defined_at": None}

    recompile = {**compile("0/1", "dynamo", 0.0), "kind": "recompile", "t1": 0.0, "reason": "size mismatch"}
    records = [compile("0/0", "dynamo", 0.0), compile("0/0", "lazy_backward", 2.0), recompile,
               compile("0/1", "dynamo", 4.0), compile("0/1", "cudagraph_recording", 6.0)]
    summary = compile_summary(Recording(records))
    assert (summary["compiles"], summary["backward_compiles"], summary["cudagraph_recordings"]) == (2, 1, 1)
    assert summary["seconds"] == 4.0
    assert compiles_line(summary) == "2 frames compiled (1 a recompile), 1 backward, 1 CUDA graph recording"
