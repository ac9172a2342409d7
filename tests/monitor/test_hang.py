"""The hang in words (alive/hang.py), from what each rank answered: the rules that name the
mismatch, on answers written by hand."""

from gpulab.monitor.alive.hang import hang_finding, mismatch, rank_line


def rank(r: int, op: str | None, seq: int = 7, line: str = "train.py:10", sizes=None) -> dict:
    collective = {"op": op, "seq": seq, "sizes": sizes or [], "dtypes": ["Float"] * len(sizes or [])} if op else None
    return {"pid": 100 + r, "rank": r, "collective": collective, "stack": [f"{line} in main"]}


def test_different_collectives_at_the_same_sequence_number():
    text = mismatch([rank(0, "all_reduce", sizes=[[4]]), rank(1, "barrier")], [])
    assert text.startswith("at collective #7 the ranks called different things (rank 0 all_reduce (4 Float); rank 1 barrier)")


def test_the_same_collective_with_different_sizes_is_a_mismatch_too():
    text = mismatch([rank(0, "all_reduce", sizes=[[4]]), rank(1, "all_reduce", sizes=[[8]])], [])
    assert text.startswith("the ranks called all_reduce #7 with different sizes (rank 0 (4 Float); rank 1 (8 Float))")


def test_a_rank_behind_the_others():
    assert "rank 1 is at #6" in mismatch([rank(0, "all_reduce", seq=7), rank(1, "all_reduce", seq=6)], [])


def test_a_rank_outside_any_collective_is_named():
    ranks = [rank(0, "all_reduce"), rank(1, None, line="train.py:30")]
    assert mismatch(ranks, []).startswith("rank 1 never reached the collective the others wait in (#7)")
    assert rank_line(ranks[1]) == "rank 1 is outside any collective at train.py:30"


def test_every_rank_in_the_same_collective_points_outside_the_job():
    assert "every rank waits in the same collective (#7)" in mismatch([rank(0, "barrier"), rank(1, "barrier")], [])


def test_a_rank_that_did_not_answer_is_named():
    said = "rank 1 (pid 101) is stopped (SIGSTOP, Ctrl-Z or a debugger): `kill -CONT 101` lets it go on"
    assert mismatch([rank(0, "barrier")], [said]) == said


def test_the_finding_points_at_the_first_waiting_rank_s_line():
    ranks = [rank(0, None, line="train.py:30"), rank(1, "barrier", line="train.py:40")]
    hang = {"idle_s": 61.0, "after_s": 60.0, "ranks": ranks, "mismatch": mismatch(ranks, [])}
    f = hang_finding(hang)
    assert f["cause"] == "hang" and f["where"] == "train.py:40"
    assert f["evidence"].startswith("no process of the job finished a step, a collective or a module call for 61 s (the limit: 60 s): ")
