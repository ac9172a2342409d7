"""A hang in words: where each rank is blocked, what does not match between them, and the fix,
from each process's answer (child.py): the collective it waits in (torch's flight recorder: op,
sequence number, sizes) and its training thread's user frames, innermost first.
"""

from __future__ import annotations

from gpulab.monitor.analyze.findings import finding

HANG_FIX = (
    "make every rank call the same collectives, in the same order, with the same sizes: look for a "
    "collective under `if rank == 0:` or another rank-dependent branch, a rank that leaves its loop "
    "early (uneven batches per rank: DistributedSampler(drop_last=True), or DDP's join() context), "
    "or a rank stuck in its own code; TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective's op "
    "and sizes across ranks as it runs"
)


def process_name(rank: int | None, pid: int | None) -> str:
    """How every line of alive/ names a process: its rank, else its pid."""
    return f"rank {rank}" if rank is not None else f"pid {pid}"


def who(forensics: dict) -> str:
    return process_name(forensics.get("rank"), forensics["pid"])


def line_of(forensics: dict) -> str | None:
    """The innermost user frame: the line that called the collective (or where the rank is)."""
    stack = forensics.get("stack") or []
    return stack[0].split(" in ")[0] if stack else None


def _sizes(c: dict) -> str:
    sizes, dtypes = c.get("sizes") or [], c.get("dtypes") or []
    if not sizes:
        return ""
    shown = ", ".join(f"{'x'.join(map(str, s)) or 'scalar'}{f' {d}' if d else ''}" for s, d in zip(sizes, dtypes + [''] * len(sizes)))
    return f" ({shown})"


def rank_line(forensics: dict) -> str:
    """'rank 0 waits in all_reduce #21 (1 Float) at train.py:38' or 'rank 1 is outside any collective, at ...'."""
    c, where = forensics.get("collective"), line_of(forensics)
    at = f" at {where}" if where else ""
    if c:
        return f"{who(forensics)} waits in {c['op']} #{c['seq']}{_sizes(c)}{at}"
    return f"{who(forensics)} is outside any collective{at}"


def mismatch(ranks: list[dict], unanswered: list[str]) -> str:
    """What does not match between the ranks: the likely cause of the hang (at least one rank
    waits in a collective: watch.py calls nothing else a hang)."""
    waiting = [r for r in ranks if r.get("collective")]
    outside = [r for r in ranks if not r.get("collective")]
    if unanswered:  # each already says why, where the process table tells (watch.py)
        return "; ".join(unanswered)
    if waiting and outside:
        return (f"{', '.join(who(r) for r in outside)} never reached the collective the others wait in "
                f"(#{waiting[0]['collective']['seq']}): stuck in its own code, or it skipped the call")
    by_seq = {r["collective"]["seq"] for r in waiting}
    ops = {(r["collective"]["op"], _sizes(r["collective"])) for r in waiting}
    if len(by_seq) > 1:
        behind = min(waiting, key=lambda r: r["collective"]["seq"] or 0)
        return (f"the ranks are at different collectives: {who(behind)} is at #{behind['collective']['seq']}, "
                f"others further on - one rank made more collective calls than another")
    if len(ops) > 1 and len({op for op, _ in ops}) == 1:
        op = next(iter(ops))[0]
        return (f"the ranks called {op} #{next(iter(by_seq))} with different sizes ("
                + "; ".join(f"{who(r)}{_sizes(r['collective'])}" for r in waiting)
                + "): a tensor whose shape differs between ranks (a last batch of another size, a shape that "
                  "depends on the rank), or one rank skipped or added a collective of the same kind")
    if len(ops) > 1:
        return (f"at collective #{next(iter(by_seq))} the ranks called different things ("
                + "; ".join(f"{who(r)} {r['collective']['op']}{_sizes(r['collective'])}" for r in waiting)
                + "): one rank skipped or added a collective")
    return (f"every rank waits in the same collective (#{next(iter(by_seq))}): a rank outside this job "
            f"(a process group's member that never joined), or the network")


def describe(hang: dict) -> list[str]:
    """The lines gpulab prints at once (stderr) and keeps in the report."""
    return [f"no process of the job finished a step, a collective or a module call for {hang['idle_s']:.0f} s "
            f"(the limit: {hang['after_s']:.0f} s)",
            *[rank_line(r) for r in hang["ranks"]],
            hang["mismatch"]]


def hang_finding(hang: dict) -> dict:
    ranks = hang["ranks"]
    where = next((line_of(r) for r in ranks if r.get("collective")), None) or next(
        (line_of(r) for r in ranks), None)
    evidence = f"{describe(hang)[0]}: " + "; ".join(rank_line(r) for r in ranks) + f" - {hang['mismatch']}"
    return finding("hang", 1.0, evidence, where, fix=HANG_FIX, share_of="the run (it stopped it)")
