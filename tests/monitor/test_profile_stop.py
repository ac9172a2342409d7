"""`gpulab profile` stops a hung job cleanly (issue 27): a 2-rank DDP job (gloo) whose rank 1
skipped one all_reduce hangs for good, both ranks blocked inside gloo where no Python signal
handler runs. SIGTERM, or Ctrl-C twice, to gpulab: within 15 s gpulab has exited, a report is
written, and no process of the job is left anywhere (torchrun starts its ranks in sessions of
their own, so a signal to the job's process group alone does not reach them)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def job_processes(marker: str) -> list[psutil.Process]:
    """Every process on the machine whose command line names this test's own fault folder."""
    found = []
    for p in psutil.process_iter(["cmdline", "environ"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []) or (p.info["environ"] or {}).get("FAULT_DIR") == marker:
                found.append(p)
        except psutil.Error:
            pass
    return found


def start_hung_job(tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    faults = tmp_path / "faults"
    faults.mkdir()
    gpulab = subprocess.Popen(
        [sys.executable, "-m", "gpulab", "profile", "--out", str(tmp_path / "prof"), "--",
         *TORCHRUN, str(SCRIPTS / "ddp_faults.py"), "hang"],
        env={**os.environ, "FAULT_DIR": str(faults)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    while not all((faults / f"rank{r}-at-fault").exists() for r in (0, 1)):
        assert gpulab.poll() is None and time.monotonic() < deadline, gpulab.communicate()[0]
        time.sleep(0.2)
    time.sleep(1.0)  # both ranks are inside gloo now (rank 0's all_reduce, rank 1's barrier)
    return gpulab, faults


def stop_everything(gpulab: subprocess.Popen, marker: str) -> None:
    for p in [*job_processes(marker), psutil.Process(gpulab.pid)] if gpulab.poll() is None else job_processes(marker):
        try:
            p.kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize("signals", [[signal.SIGTERM], [signal.SIGINT, signal.SIGINT]], ids=["sigterm", "ctrl-c-twice"])
def test_a_hung_ddp_job_is_stopped_cleanly_with_nothing_left_behind(tmp_path, signals):
    gpulab, faults = start_hung_job(tmp_path)
    try:
        assert len(job_processes(str(faults))) >= 3  # torchrun and its two ranks
        sent = time.monotonic()
        for signum in signals:
            gpulab.send_signal(signum)
            time.sleep(0.5)
        output, _ = gpulab.communicate(timeout=30)
        took = time.monotonic() - sent
        left = job_processes(str(faults))
        assert left == [], [p.info["cmdline"] for p in left]
        assert took < 15, (took, output)
        assert gpulab.returncode != 0
        report = json.loads((tmp_path / "prof" / "report.json").read_text())
        assert {p["rank"] for p in report["processes"] if p["rank"] is not None} == {0, 1}
    finally:
        stop_everything(gpulab, str(faults))
