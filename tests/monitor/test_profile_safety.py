"""A profiler must never break the job it measures (issue 33: on an H200, 4 of 9 profiled CUDA
scripts ended with SIGSEGV inside a garbage collection). What gpulab hangs on a job's tensors is
nothing: no weak reference, no finalizer, no Python object on a storage - checked here on the
CPU under collection pressure with helper threads alive, by the script's own count; the same
script on a GPU is in tests/monitor/test_gpu.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"


def profile(tmp_path: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "prof"
    done = subprocess.run([sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--", sys.executable,
                           str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=300)
    return done, read_report(out)


def truth(stdout: str) -> dict[str, str]:
    line = next(line for line in stdout.splitlines() if line.startswith("TRUTH "))
    words = line.split()[1:]
    return dict(zip(words[0::2], words[1::2]))


def test_a_job_under_collection_pressure_ends_as_it_would_and_holds_nothing_of_gpulab(tmp_path):
    done, report = profile(tmp_path, "gc_pressure.py", "40")
    assert done.returncode == 0, done.stderr[-2000:]
    told = truth(done.stdout)
    # measured by the script after every step, the memory window's steps included
    assert told["most_weakrefs_on_tensors"] == "0" and told["most_finalizers_on_tensors"] == "0", told
    assert "error" not in report["memory"] and report["memory"]["sizes"]["activations"] > 0
    assert report["steps"] == 40
    # an eager script: torch.compile's probe stays silent (it installs, and no compile happens)
    assert report["compile"] is None and "compile" not in {f["cause"] for f in report["findings"]}
    assert not re.search(r"Warning|Traceback|Fatal", done.stderr), done.stderr[-2000:]
