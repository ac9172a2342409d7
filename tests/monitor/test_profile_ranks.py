"""`gpulab profile` of a torchrun job (issue 9): every rank recorded, diagnosed across ranks.

Real 2-rank DDP jobs over gloo on loopback (tests/monitor/scripts/ddp_ranks.py), launched by
torchrun under the profiler, with a straggler planted on rank 1 (or none).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpulab.cli import main
from tests.monitor.reports import read_report

SCRIPTS = Path(__file__).parent / "scripts"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]



def profile_job(tmp_path: Path, mode: str, launcher: list[str] = TORCHRUN) -> dict:
    out = tmp_path / "prof"
    code = main(["profile", "--out", str(out), "--", *launcher, str(SCRIPTS / "ddp_ranks.py"), mode])
    assert code == 0
    return read_report(out)


def ranks(report: dict) -> dict[int, dict]:
    return {p["rank"]: p for p in report["processes"] if p["rank"] is not None}


@pytest.mark.parametrize("mode, category", [("slow-data", "data wait"), ("item", "other Python")])
def test_a_planted_straggler_is_named_with_its_rank_phase_and_line(tmp_path, mode, category):
    report = profile_job(tmp_path, mode)
    assert {k: p["steps"] for k, p in ranks(report).items()} == {0: 40, 1: 40}
    # On a machine with a GPU this CPU job also gets cpu_only_torch (the GPU sits unused), which
    # may rank first; among the findings about the training itself the straggler comes first.
    top = next(f for f in report["findings"] if f["cause"] != "cpu_only_torch")
    assert top["cause"] == "straggler" and top["rank"] == 1, top
    assert "rank 1 spends" in top["evidence"] and f"in {category} than the other ranks" in top["evidence"]
    assert "rank 0 waits for it" in top["evidence"]  # rank 0's extra time is inside backward (DDP)
    lines = (SCRIPTS / "ddp_ranks.py").read_text().splitlines()
    planted = next(i for i, line in enumerate(lines, 1) if "# planted:" in line and (
        "decode" in line if mode == "slow-data" else "host work" in line))
    assert top["where"].endswith(f"ddp_ranks.py:{planted}")


@pytest.fixture(scope="module")
def balanced(tmp_path_factory) -> dict:
    """The balanced job's report, profiled once through the `torchrun` command itself when it
    stands next to this Python (else `python -m torch.distributed.run`): {"report", "out", "launcher"}."""
    out = tmp_path_factory.mktemp("balanced")
    torchrun = Path(sys.executable).with_name("torchrun")
    launcher = [str(torchrun), "--standalone", "--nproc-per-node", "2"] if torchrun.exists() else TORCHRUN
    return {"report": profile_job(out, "balanced", launcher), "out": out / "prof", "launcher": launcher}


def test_a_balanced_job_has_no_straggler(balanced):
    report = balanced["report"]
    assert {k: p["steps"] for k, p in ranks(report).items()} == {0: 40, 1: 40}
    assert "straggler" not in [f["cause"] for f in report["findings"]]
    assert "unbalanced_data" not in [f["cause"] for f in report["findings"]]


def test_a_communication_bound_ddp_job_is_named_from_ddp_s_own_timers(tmp_path):
    # 4M parameters on batches of 2: the 16 MB allreduce outlasts each step's computation on both
    # ranks alike. DDP waits for it inside backward (C++); its own timers move that wait to collectives.
    report = profile_job(tmp_path, "comm-bound")
    top = report["findings"][0]
    assert top["cause"] == "communication_bound", [(f["cause"], f["share"]) for f in report["findings"]]
    assert "straggler" not in [f["cause"] for f in report["findings"]]
    assert report["collectives"]["ddp_backward_wait_ms_per_step"] > 0
    for lane in ranks(report).values():
        assert lane["phases"]["collective"] >= 0.25


def test_explicit_all_reduce_calls_are_collective_time_at_their_line(tmp_path):
    report = profile_job(tmp_path, "manual-allreduce")
    lines = (SCRIPTS / "ddp_ranks.py").read_text().splitlines()
    planted = next(i for i, line in enumerate(lines, 1) if "# planted: the gradient average" in line)
    for lane in ranks(report).values():
        assert lane["phases"]["collective"] > 0.1
    assert "ddp_backward_wait_ms_per_step" not in report["collectives"]  # no DDP in this job
    comm = next(f for f in report["findings"] if f["cause"] == "communication_bound")
    assert comm["where"].endswith(f"ddp_ranks.py:{planted}")


def test_the_torchrun_command_itself_can_be_profiled(balanced):
    if balanced["launcher"] == TORCHRUN:
        pytest.skip("no torchrun script next to this Python")
    assert sorted(ranks(balanced["report"])) == [0, 1]


def test_killing_gpulab_stops_every_rank(tmp_path):
    gpulab = subprocess.Popen(
        [sys.executable, "-m", "gpulab", "profile", "--out", str(tmp_path / "prof"), "--", *TORCHRUN,
         str(SCRIPTS / "ddp_ranks.py"), "slow-data"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    job: list[psutil.Process] = []
    while len([p for p in job if "ddp_ranks.py" in " ".join(p.cmdline())]) < 2:
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
        try:
            job = psutil.Process(gpulab.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pytest.fail("gpulab ended before the ranks started")
    gpulab.kill()
    gpulab.wait()
    gone, alive = psutil.wait_procs(job, timeout=20)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE], [p.cmdline() for p in alive]
    assert not list((tmp_path / "prof").glob(".events-*"))


def test_the_trace_has_one_process_per_rank(balanced):
    events = json.loads((balanced["out"] / "trace.json").read_text())["traceEvents"]
    names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
    assert sum(n.startswith("rank 0 ") for n in names) == 1 and sum(n.startswith("rank 1 ") for n in names) == 1


def test_ranks_with_unequal_step_counts_are_called_unbalanced():
    from gpulab.monitor.config import ProfileConfig
    from gpulab.monitor.events import Recording
    from gpulab.monitor.output.report import build_report

    def rank(r: int, n: int) -> Recording:
        steps = [{"type": "step", "i": i, "t0": float(i), "t1": i + 1.0, "counts": {}, "data": [],
                  "excl": {"data_wait": 0.1, "h2d": 0.0, "compute": 0.8, "sync": 0.0, "other": 0.1}} for i in range(n)]
        return Recording([{"type": "process", "pid": 10 + r}, {"type": "start", "pid": 10 + r, "rank": r, "t": 0.0},
                          *steps, {"type": "facts", "step_rule": "optimizer"},
                          {"type": "end", "t": n + 1.0, "exit_code": None, "error": None}])

    report, lanes = build_report([rank(0, 8), rank(1, 6)], 99, [], [], {}, ProfileConfig(), exit_code=1)
    assert report["findings"][0]["cause"] == "unbalanced_data" and report["findings"][0]["share"] == 0.25
    assert "rank 0: 8, rank 1: 6" in report["findings"][0]["evidence"]
    assert [r.start["rank"] for r in lanes] == [0, 1]
