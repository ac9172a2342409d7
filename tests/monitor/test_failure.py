"""Which process failed first, and how (alive/failure.py), on recordings written by hand."""

from gpulab.monitor.alive.failure import _crash_where, failure_finding, job_failure
from gpulab.monitor.events import Recording


def rank(r: int, steps: int, end: dict | None, tally: int | None = None) -> Recording:
    records = [{"type": "process", "pid": 100 + r}, {"type": "start", "pid": 100 + r, "rank": r, "t": 0.0},
               *[{"type": "step", "i": i, "t0": float(i), "t1": i + 1.0, "excl": {}, "counts": {}, "data": []}
                 for i in range(steps)]]
    lane = Recording(records + ([{"type": "end", **end}] if end else []))
    lane.tally = (tally, float(tally)) if tally else None
    return lane


def test_a_lost_peer_is_a_consequence_even_when_it_is_said_first():
    """Rank 0's "Connection reset by peer" is written before rank 1's own error: rank 1 failed first."""
    lanes = [rank(0, 5, {"t": 5.2, "exit_code": 1, "error": "RuntimeError: [pair.cc:537] Connection reset by peer"}),
             rank(1, 5, {"t": 5.5, "exit_code": 1, "error": "ValueError: bad label 12", "where": "train.py:30"})]
    failure = job_failure(lanes, stopped_by_gpulab=False)
    assert failure["first"]["who"] == "rank 1" and failure["first"]["where"] == "train.py:30"
    finding = failure_finding(failure)
    assert finding["rank"] == 1 and finding["evidence"].startswith("rank 1 (pid 101) failed first, after 5 steps: ValueError")


def test_a_rank_without_an_end_record_was_killed_and_its_tally_counts_its_steps():
    lanes = [rank(0, 3, None, tally=21), rank(1, 21, {"t": 30.0, "exit_code": 143, "error": "stopped by SIGTERM"})]
    failure = job_failure(lanes, stopped_by_gpulab=False)
    assert failure["first"]["how"] == "killed" and failure["first"]["steps"] == 21
    # ... unless gpulab itself stopped the job (a hang): then nobody failed on its own
    assert job_failure([rank(0, 3, None, tally=21)], stopped_by_gpulab=True) is None


def test_a_job_that_ended_well_has_no_failure():
    assert job_failure([rank(0, 4, {"t": 4.0, "exit_code": 0, "error": None})], stopped_by_gpulab=False) is None


def test_a_crash_is_placed_at_the_crashing_thread_s_user_frame():
    text = """Fatal Python error: Segmentation fault

Thread 0x00007f1 (most recent call first):
  File "/home/u/other.py", line 3 in helper

Current thread 0x00007f2 (most recent call first):
  File "/usr/lib/python3.11/ctypes/__init__.py", line 519 in string_at
  File "/home/u/train.py", line 45 in main

Thread 0x00007f3 (most recent call first):
  File "/home/u/x.py", line 9 in y
"""
    assert _crash_where(text) == "/home/u/train.py:45"
