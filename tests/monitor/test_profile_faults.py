"""`gpulab profile` when the job goes wrong (issue 27), on a 2-rank DDP job (gloo) whose rank 1
skips one all_reduce and so hangs for good, both ranks blocked inside gloo where no Python signal
handler runs (tests/monitor/scripts/ddp_faults.py).

- Stopped by the user: SIGTERM, or Ctrl-C twice, to gpulab: within 15 s gpulab has exited, a
  report is written, and no process of the job is left anywhere (torchrun starts its ranks in
  sessions of their own, so a signal to the job's process group alone does not reach them).
- Found by gpulab: with --hang-after 5 it names each rank's collective, sequence number and line,
  the mismatch between them, and stops the job itself.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from gpulab.cli import main

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


def planted_line(text: str) -> int:
    lines = (SCRIPTS / "ddp_faults.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.strip() == text)


def test_a_hang_is_found_named_rank_by_rank_and_stopped(tmp_path, monkeypatch, capfd):
    faults = tmp_path / "faults"
    faults.mkdir()
    monkeypatch.setenv("FAULT_DIR", str(faults))
    started = time.monotonic()
    code = main(["profile", "--hang-after", "5", "--out", str(tmp_path / "prof"), "--",
                 *TORCHRUN, str(SCRIPTS / "ddp_faults.py"), "hang"])
    took = time.monotonic() - started
    err = capfd.readouterr().err
    assert code != 0
    assert job_processes(str(faults)) == []
    report = json.loads((tmp_path / "prof" / "report.json").read_text())
    hang = report["findings"][0]
    assert hang["cause"] == "hang", report["findings"]
    all_reduce, barrier = planted_line("dist.all_reduce(total)"), planted_line("dist.barrier()")
    ranks = {r["rank"]: r for r in report["hang"]["ranks"]}
    assert ranks[0]["collective"]["op"] == "all_reduce" and ranks[1]["collective"]["op"] == "barrier"
    seq = ranks[0]["collective"]["seq"]
    assert ranks[1]["collective"]["seq"] == seq
    assert f"rank 0 waits in all_reduce #{seq} (1 Float) at " in hang["evidence"]
    assert f"ddp_faults.py:{all_reduce}" in hang["evidence"] and f"ddp_faults.py:{barrier}" in hang["evidence"]
    assert f"rank 1 waits in barrier #{seq} at" in hang["evidence"]
    assert "the ranks called different things" in hang["evidence"]
    assert hang["where"].endswith(f"ddp_faults.py:{all_reduce}")
    assert "gpulab profile: the job hangs" in err and f"rank 1 waits in barrier #{seq}" in err
    # steps come from the helper thread's writes: both ranks' 21 steps, though neither ever
    # returned to Python to flush
    assert {p["rank"]: p["steps"] for p in report["processes"] if p["rank"] is not None} == {0: 21, 1: 21}
    assert took < 60, took


def test_long_work_outside_collectives_is_no_hang(tmp_path, monkeypatch, capfd):
    """Rank 0 evaluates alone for 8 s (forward calls, no step) while rank 1 waits in a barrier;
    a single process pauses 6 s between steps: with --hang-after 3 neither is called a hang nor
    stopped (the watch counts finished module calls as progress, and calls a job hung only with
    a rank inside a collective)."""
    monkeypatch.setenv("FAULT_DIR", str(tmp_path))
    code = main(["profile", "--hang-after", "3", "--out", str(tmp_path / "ddp"), "--",
                 *TORCHRUN, str(SCRIPTS / "ddp_faults.py"), "eval"])
    assert code == 0, capfd.readouterr().err[-3000:]
    pause = ("import time, torch\nm = torch.nn.Linear(4, 1); o = torch.optim.SGD(m.parameters(), lr=0.1)\n"
             "for i in range(20):\n    m(torch.randn(2, 4)).sum().backward(); o.step()\n    if i == 10: time.sleep(6)\n")
    code = main(["profile", "--hang-after", "3", "--out", str(tmp_path / "one"), "--", sys.executable, "-c", pause])
    assert code == 0
    for out in ("ddp", "one"):
        report = json.loads((tmp_path / out / "report.json").read_text())
        assert "hang" not in report and all(f["cause"] != "hang" for f in report["findings"])
    assert "the job hangs" not in capfd.readouterr().err
