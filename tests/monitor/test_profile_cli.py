"""`gpulab profile -- python script.py` end to end, on small CPU scripts with planted causes.

Each test runs a real child Python process under the profiler (a few seconds: importing torch
dominates), then checks the diagnosis, the outputs, and that the script kept its exit code and
its own stdout/stderr.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gpulab.cli import main
from gpulab.devices import native_bf16
from gpulab.io import OUTPUTS_RECORD
from gpulab.monitor.analyze.findings import FIXES
from tests.conftest import assert_one_line_error, disk_full_for, run_cli
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"
REPORT_KEYS = {"steps", "step_time_s", "phases", "devices", "findings"}
CAUSES = {"input_pipeline", "host_sync", "launch_overhead", "h2d_copy", "cpu_only_torch", "low_device_utilization",
          "evaluation", "none"}


def planted_line(script: str, marker: str = "# planted:") -> int:
    """The line number of the `# planted:` comment (or of `marker`) in a test script."""
    lines = (SCRIPTS / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if marker in line)


def profile(tmp_path: Path, script: str, *args: str) -> tuple[int, dict, Path]:
    out = tmp_path / "prof"
    code = main(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / script), *args])
    return code, read_report(out), out


def check_report_shape(report: dict) -> None:
    assert REPORT_KEYS <= set(report)
    assert isinstance(report["steps"], int)
    assert set(report["step_time_s"]) == {"median", "p90"}
    assert set(report["phases"]) == {"data_wait", "compute", "collective", "sync", "h2d", "compile", "other"}
    assert all(0 <= v <= 1 for v in report["phases"].values())
    assert report["findings"]
    for f in report["findings"]:
        assert set(f) == {"cause", "share", "evidence", "where", "fix", "support"} and "steady steps" in f["support"]
        assert f["cause"] in CAUSES and 0 <= f["share"] <= 1 and f["evidence"] and f["fix"]
    shares = [f["share"] for f in report["findings"]]
    assert shares == sorted(shares, reverse=True)


def test_slow_getitem_is_diagnosed_input_pipeline(tmp_path, capfd):
    code, report, out = profile(tmp_path, "slow_dataset.py")
    captured = capfd.readouterr()
    assert code == 0
    assert "slow_dataset: done" in captured.out  # the script's stdout is its own
    check_report_shape(report)
    top = report["findings"][0]
    assert top["cause"] == "input_pipeline"
    assert top["share"] >= 0.5
    assert top["where"].endswith(f"slow_dataset.py:{planted_line('slow_dataset.py')}")
    # the fetch sleeps: workers are advised, as many as keep up with the 1 ms rest of the step (32 ms
    # of sleep a batch), at most 4 a core - with the command that measures them
    assert f"--try num_workers={4 * os.cpu_count()} --steps 30" in top["fix"] and "the fetch was blocked" in top["fix"]
    assert report["steps"] == 20  # 320 samples / batch 16
    assert "input_pipeline" in captured.err  # the short report on the terminal (stderr)
    for name in ("report.json", "timeline.png", "trace.json"):
        assert (out / name).is_file()
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    trace = json.loads((out / "trace.json").read_text())
    phases = {e["ph"] for e in trace["traceEvents"]}
    assert {"X", "C", "M"} <= phases  # spans, sampled counters, track names
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"step 5", "next(DataLoader)", "Sequential", "SGD.step"} <= names
    assert not list(out.glob(".events-*"))  # the child's raw record is cleaned up


def test_fast_in_memory_pipeline_is_not_input_bound(tmp_path, capfd):
    code, report, _ = profile(tmp_path, "fast_dataset.py")
    assert code == 0
    assert "fast_dataset: mean loss" in capfd.readouterr().out
    check_report_shape(report)
    assert "input_pipeline" not in [f["cause"] for f in report["findings"]]
    assert report["phases"]["compute"] > report["phases"]["data_wait"]
    # a busy loop is told the cheaper math it could use, from how it runs: an MLP in fp32, no
    # 4-D weight (so no channels_last), not compiled; bf16 where this CPU has it natively
    fix = next(f for f in report["findings"] if f["cause"] == "none")["fix"]
    assert "torch.compile" in fix and "channels_last" not in fix and "already" not in fix, fix
    assert ("mixed precision: bf16 autocast" in fix) == native_bf16(torch.device("cpu")), fix


def test_python_loop_between_steps_is_found_at_its_line(tmp_path, capfd):
    """The cost of every step at the loop that runs every step, not at the job in two steps that
    took longer (the script's own clock says so)."""
    code, report, _ = profile(tmp_path, "python_overhead.py")
    assert code == 0
    once_s, loops_s = map(float, re.search(r"a job of ([\d.]+) s in two steps, the loop ([\d.]+) s", capfd.readouterr().out).groups())
    assert once_s > loops_s
    top = report["findings"][0]
    assert top["cause"] == "low_device_utilization" and top["fix"] == FIXES["low_device_utilization"]
    loop = planted_line("python_overhead.py")  # the `for` line; its body is the next line
    assert top["where"] in {f"{SCRIPTS / 'python_overhead.py'}:{n}" for n in (loop, loop + 1)} | {
        f"tests/monitor/scripts/python_overhead.py:{n}" for n in (loop, loop + 1)}


def test_a_forward_written_with_torch_functions_is_compute_and_the_python_beside_it_is_not(tmp_path):
    """No nn.Module runs, so no module's forward marks the forward as compute: the operators
    window finds the lines whose time is torch operators, and the Python the script plants beside
    them (its own clock says how much of the step each takes) is what stays "other Python", at
    its line."""
    truth_file = tmp_path / "truth.json"
    code, report, _ = profile(tmp_path, "functional_forward.py", str(truth_file), "--python")
    truth = json.loads(truth_file.read_text())
    assert code == 0
    assert report["phases"]["compute"] >= truth["forward"]
    assert report["phases"]["other"] == pytest.approx(truth["python"], abs=0.12)  # stack samples place the lines
    assert f"tests/monitor/scripts/functional_forward.py:{planted_line('functional_forward.py', 'def forward') + 1}" \
        in report["operators_outside_modules"]["lines"]
    top = report["findings"][0]
    assert top["cause"] == "low_device_utilization" and top["where"] in (
        f"tests/monitor/scripts/functional_forward.py:{planted_line('functional_forward.py')}", None)


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
@pytest.mark.parametrize("persistent", [False, True])
def test_workers_started_again_every_epoch_are_named_with_their_share_of_the_training(tmp_path, capfd, persistent):
    """Each epoch's workers take 0.3 s to get ready: the passes after the first cost that much each,
    a share of the whole training the script measures itself; the steady steps leave those steps
    out, and they are no stall. With persistent workers nothing of it is said."""
    code, report, _ = profile(tmp_path, "workers_restart.py", *(["--persistent"] if persistent else []))
    assert code == 0
    started_s, total_s = map(float, re.search(r"started in ([\d.]+) s of ([\d.]+) s", capfd.readouterr().out).groups())
    restarts = [f for f in report["findings"] if f["fix"] == FIXES["input_pipeline_restart"]]
    assert not report["stalls"]
    if persistent:
        assert not restarts
        return
    restart, = restarts
    assert restart["share_of"] == "the training time" and "3 passes" in restart["evidence"]
    # the first pass's start is paid whatever the settings: 3 of the 4 count
    assert restart["share"] == pytest.approx(0.75 * started_s / total_s, abs=0.15)
    assert restart["where"].endswith(f"workers_restart.py:{planted_line('workers_restart.py', 'iter(loader)')}")


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_loop_waiting_on_a_prefetching_thread_s_dataloader_is_input_bound(tmp_path, capfd):
    """The loop waits at its queue while a thread of the script's iterates the DataLoader: what it
    waits for is the input pipeline, so the fix feeds that DataLoader - not "move the wait to a
    background thread", where it already is."""
    code, report, _ = profile(tmp_path, "prefetch_thread.py")
    assert code == 0
    waited_s, total_s = map(float, re.search(r"waited ([\d.]+) s of ([\d.]+) s", capfd.readouterr().out).groups())
    top = report["findings"][0]
    assert top["cause"] == "input_pipeline" and "iterated in another thread" in top["evidence"]
    assert top["share"] == pytest.approx(waited_s / total_s, abs=0.15)
    assert top["where"].endswith(f"prefetch_thread.py:{planted_line('prefetch_thread.py')}")
    assert top["fix"].startswith("feed that DataLoader faster: give it workers (DataLoader(num_workers=")
    assert [loader["elsewhere"] for loader in report["data_loaders"]] == [True]


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_an_evaluation_every_few_steps_is_named_with_its_share_of_the_training(tmp_path, capfd):
    """Passes over a DataLoader that feeds no step are evaluations: their share of the whole
    training, measured by the script's own clock, at the line that iterates that loader; and the
    samples of the long steps they fall in place no steady cost at their lines."""
    code, report, _ = profile(tmp_path, "evaluates_often.py")
    assert code == 0
    evaluated_s, total_s = map(float, re.search(r"evaluated ([\d.]+) s of ([\d.]+) s", capfd.readouterr().out).groups())
    evaluation, = [f for f in report["findings"] if f["cause"] == "evaluation"]
    assert evaluation["share"] == pytest.approx(evaluated_s / total_s, abs=0.15)
    assert evaluation["share_of"] == "the training time" and "8 passes" in evaluation["evidence"]
    assert evaluation["where"].endswith(f"evaluates_often.py:{planted_line('evaluates_often.py')}")
    assert evaluation["fix"] == FIXES["evaluation"]
    # (the evaluation after the last step is the run's tail: its samples count once)
    evaluation_lines = tuple(f"evaluates_often.py:{planted_line('evaluates_often.py') + n}" for n in (1, 2))
    assert all(n <= 1 for where, n in report["hot_steps"].get("other", {}).items() if where.endswith(evaluation_lines))
    assert not any((f["where"] or "").endswith(evaluation_lines) for f in report["findings"])


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_wait_between_steps_is_called_a_wait_at_its_line(tmp_path, capfd):
    """A sleep after every step is time between the training calls, but no Python to speed up: the
    finding names the sleep's line and the fix that takes the wait out of the loop."""
    code, report, _ = profile(tmp_path, "sleeps_between_steps.py")
    assert code == 0
    slept_s, total_s = map(float, re.search(r"slept ([\d.]+) s of ([\d.]+) s", capfd.readouterr().out).groups())
    assert slept_s > 0.5 * total_s
    top = report["findings"][0]
    assert top["cause"] == "low_device_utilization" and top["fix"] == FIXES["host_wait"]
    assert "blocked" in top["evidence"]
    assert top["where"].endswith(f"sleeps_between_steps.py:{planted_line('sleeps_between_steps.py')}")


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_script_that_fails_before_its_first_step_is_told_why_first(tmp_path, capfd):
    """A spawned DataLoader worker died before the first batch (no __main__ guard): the report was
    'input_pipeline 100%... an inference-only run' with worker advice; the failure comes first now,
    with the guard that fixes it."""
    code, report, _ = profile(tmp_path, "spawned_worker_dies.py")
    assert code == 1 and report["steps"] == 0
    top = report["findings"][0]
    assert top["cause"] == "failure" and "DataLoader worker" in top["evidence"] and "after 0 steps" in top["evidence"]
    assert top["where"].endswith(f"spawned_worker_dies.py:{planted_line('spawned_worker_dies.py')}")
    assert "if __name__ == '__main__':" in top["fix"]


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_failing_script_keeps_exit_code_and_output_and_leaves_a_partial_report(tmp_path, capfd):
    code, report, _ = profile(tmp_path, "failing.py")
    captured = capfd.readouterr()
    assert code == 1
    assert "failing: step 5" in captured.out
    assert "failing: about to stop" in captured.err
    assert "RuntimeError: planted failure" in captured.err
    assert "failing.py" in captured.err and "gpulab" not in captured.err.split("gpulab profile:")[0]  # the user's traceback only
    check_report_shape(report)
    assert report["steps"] == 6
    assert report["exit_code"] == 1 and report["complete"] is False
    assert report["error"] == "RuntimeError: planted failure"


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_runs_as_python_dash_m_gpulab_from_pythonpath(tmp_path):
    """`PYTHONPATH=src python -m gpulab profile` works, and the child finds gpulab the same way
    (this venv also has gpulab installed; test_the_child_finds_gpulab_through_pythonpath checks the
    PYTHONPATH the child gets)."""
    src = Path(__file__).resolve().parents[2] / "src"
    out = tmp_path / "prof"
    result = subprocess.run(
        [sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--", sys.executable, "-c",
         "import torch; m = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
         "for _ in range(5):\n  m(torch.randn(8, 4)).sum().backward(); o.step()\nprint('inline done')"],
        env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "inline done" in result.stdout
    assert read_report(out)["steps"] == 5


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to profile"),
    (["--"], "nothing to profile"),
    (["--", "bash", "train.sh"], "not a Python interpreter"),
    (["--", "train.py"], "gpulab profile -- python train.py"),
    (["--", sys.executable], "no script given"),
    (["--", sys.executable, "no_such_script.py"], "script no_such_script.py not found"),
    (["--", sys.executable, str(Path(__file__).parent)], "a folder without __main__.py"),
    (["--", sys.executable, "-m"], "needs a module"),
    (["--", sys.executable, "-"], "stdin"),
    (["--interval", "0", "--", sys.executable, "x.py"], "--interval 0"),
    (["--", "/no/such/python3", "x.py"], "'/no/such/python3' not found"),
    (["--", sys.executable, "-I", "x.py"], "drop -I"),
    (["--try", "workers=2", "--", sys.executable, "x.py"], "KEY one of num_workers"),
    (["--try", "num_workers=two", "--", sys.executable, "x.py"], "num_workers is a whole number"),
])
def test_bad_command_lines_are_one_line_errors(argv, message, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0 and err.startswith("gpulab: error:")


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_folder_with_a_main_runs_as_python_runs_it(tmp_path, capfd):
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text("import torch\nprint('app ran', torch.ones(2).sum().item())\n")
    assert main(["profile", "--out", str(tmp_path / "prof"), "--", sys.executable, str(app)]) == 0
    assert "app ran 2.0" in capfd.readouterr().out


TORCHRUN = str(Path(sys.executable).parent / "torchrun")


@pytest.mark.parametrize("launcher", [[TORCHRUN], [sys.executable, "-m", "torch.distributed.run"]],
                         ids=["torchrun", "python -m torch.distributed.run"])
def test_a_launcher_whose_script_is_missing_is_refused_before_anything_runs(launcher, tmp_path, capsys):
    out = tmp_path / "prof"
    argv = ["profile", "--out", str(out), "--", *launcher, "--standalone", "--nproc-per-node", "2", "nosuch.py"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"gpulab: error: script nosuch.py not found: check the path (relative to {Path.cwd()})"
    assert not out.exists()


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_a_full_disk_is_one_line_and_the_script_keeps_its_sys_exit_code(tmp_path, capfd, monkeypatch):
    """The job ran and called sys.exit(3): its exit code stays the answer; the report that could
    not be written is one line, and no file is left half-written (the ones before it are whole)."""
    disk_full_for(monkeypatch, "timeline.png")
    out = tmp_path / "prof"
    code = main(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / "failing.py"), "--exit", "3"])
    err = capfd.readouterr().err
    assert code == 3
    assert err.splitlines()[-1] == (f"gpulab profile: cannot write {out / 'timeline.png'}: No space left on device; "
                                    f"free space or use --out DIR")
    assert "Traceback" not in err and "wrote" not in err
    assert sorted(p.name for p in out.iterdir()) == [OUTPUTS_RECORD, "report.json"]
    report = read_report(out)
    assert report["exit_code"] == 3 and report["steps"] == 6


def test_an_interpreter_that_cannot_start_is_one_line_and_leaves_no_folder(tmp_path, capsys):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir()
    fake.write_bytes(b"\x7fELF not a program")
    fake.chmod(0o755)
    (tmp_path / "train.py").write_text("")
    out = tmp_path / "new" / "prof"
    code, _, err = run_cli(["profile", "--out", str(out), "--", str(fake), str(tmp_path / "train.py")], capsys)
    assert_one_line_error(code, err, f"could not start {fake} (Exec format error): give the path of a Python interpreter")
    assert not (tmp_path / "new").exists()


def test_output_path_that_is_a_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["profile", "--out", str(blocker), "--", sys.executable, str(SCRIPTS / "failing.py")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_the_child_finds_gpulab_through_pythonpath(monkeypatch, tmp_path):
    from gpulab.monitor.config import ProfileConfig
    from gpulab.monitor.parent.runner import job_env

    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    src = Path(__file__).resolve().parents[2] / "src"
    autostart = str(src / "gpulab" / "monitor" / "record" / "autostart")
    assert job_env(tmp_path, ProfileConfig())["PYTHONPATH"].split(":") == [autostart, str(src), "/somewhere/else"]


@pytest.mark.shares_the_cores  # against its own clock, or no timing at all
def test_the_script_imports_torch_itself(tmp_path, capfd):
    code, report, _ = profile(tmp_path, "sets_threads.py")
    assert code == 0
    assert "torch threads: 1" in capfd.readouterr().out
    assert report["steps"] == 4 and report["environment"]["torch_threads"] == 1
