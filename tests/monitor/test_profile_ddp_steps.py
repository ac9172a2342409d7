"""Sub-millisecond DDP steps (issue 28, item 9): the DDP tutorial series' script on 2 gloo ranks
(tests/monitor/scripts/ddp_tutorial.py), which measures its own step time and DDP's wait in the
same run. DDP's allreduce is collective time, at every step; the median step is the script's own;
the loop's ~0.1 ms of Python, near MIN_SHARE of a ~1 ms step, is no finding that comes and goes.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from gpulab.cli import main
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
TRUTH = re.compile(r"rank (\d) steps (\d+) median step (\S+) ms DDP wait (\S+) ms")


def profile_tutorial(out: Path, capfd) -> tuple[dict, dict[int, dict]]:
    """The report, and each rank's own numbers: steps, median step and DDP wait (seconds)."""
    assert main(["profile", "--out", str(out), "--", *TORCHRUN, str(SCRIPTS / "ddp_tutorial.py")]) == 0
    truth = {int(r): {"steps": int(n), "median_step_s": float(s) / 1e3, "wait_s": float(w) / 1e3}
             for r, n, s, w in TRUTH.findall(capfd.readouterr().out)}
    assert sorted(truth) == [0, 1]
    return read_report(out), truth


def ddp_waits_in_the_trace(out: Path) -> dict[int, list[float]]:
    """Each rank's "DDP allreduce wait" spans (seconds), one per step recorded in trace.json."""
    events = json.loads((out / "trace.json").read_text())["traceEvents"]
    rank_of = {e["pid"]: int(e["args"]["name"].split()[1]) for e in events
               if e["name"] == "process_name" and e["args"]["name"].startswith("rank ")}
    waits: dict[int, list[float]] = {}
    for e in events:
        if e["name"] == "DDP allreduce wait":
            waits.setdefault(rank_of[e["pid"]], []).append(e["dur"] / 1e6)
    return waits


def ranks(report: dict) -> dict[int, dict]:
    return {p["rank"]: p for p in report["processes"] if p["rank"] is not None}


def unnamed_python_findings(report: dict) -> list[dict]:
    return [f for f in report["findings"] if f["cause"] == "low_device_utilization" and f["where"] is None]


def test_ddp_s_allreduce_is_collective_time_and_the_median_step_is_the_script_s_own(tmp_path, capfd):
    report, truth = profile_tutorial(tmp_path / "prof", capfd)
    lanes = ranks(report)
    assert {k: p["steps"] for k, p in lanes.items()} == {0: 64, 1: 64} == {k: t["steps"] for k, t in truth.items()}
    # DDP waits for its one bucket inside backward, in C++: measured there at every step, not
    # left in compute (before: collectives null, or DDP's start-up samples moving all compute)
    assert report["collectives"]["ddp_backward_wait_ms_per_step"] > 0
    waits = ddp_waits_in_the_trace(tmp_path / "prof")
    for rank, own in truth.items():  # the same wait, by the script's own hook and clock
        assert len(waits.get(rank, [])) == 64
        assert statistics.median(waits[rank]) == pytest.approx(own["wait_s"], rel=0.25), (rank, own)
    for rank, lane in lanes.items():
        own_share = truth[rank]["wait_s"] / truth[rank]["median_step_s"]
        assert lane["phases"]["collective"] >= 0.5 * own_share, (rank, lane["phases"], truth[rank])
        assert lane["phases"]["compute"] > 0, (rank, lane["phases"])
        # the script's own clock in the same run (it includes the recorder's time between steps,
        # which gpulab leaves out: measured 1-3% apart on this 2-core VM)
        assert lane["median_step_s"] == pytest.approx(truth[rank]["median_step_s"], rel=0.25), (rank, truth[rank])
    assert not unnamed_python_findings(report), report["findings"]


@pytest.mark.slow
def test_the_loop_s_python_near_the_threshold_is_no_finding_in_any_run(tmp_path, capfd):
    for run in range(3):
        report, _ = profile_tutorial(tmp_path / str(run), capfd)
        assert not unnamed_python_findings(report), (run, report["phases"], report["findings"])
