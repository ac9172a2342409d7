"""Stalls: one step far longer than the others, the job standing still for seconds, then going on.

The steady statistics leave such a step out (an outlier), so it gets a finding of its own: who
stalled, for how long, in which step, and where. In a synchronous job every rank's step grows by
the stall; who stalled shows in what the steps are made of (the stalled rank's own Python or
I/O, the others' wait in a collective or DDP's backward) and in the hang watch's snapshot taken
during it (watch.py): the rank outside any collective is the one the others wait for.
"""

from __future__ import annotations

import statistics

from gpulab.monitor.alive.hang import line_of, process_name, rank_line
from gpulab.monitor.analyze.findings import finding
from gpulab.monitor.analyze.step_costs import PHASE_NAMES, step_seconds
from gpulab.monitor.events import PASS_START_COUNT, Recording, trainers

STALL_FACTOR = 20.0  # a step this many times the median ...
MIN_STALL_S = 1.0  # ... and at least this long is a stall
MAX_SHOWN = 5  # stalls named in the report (the longest)
_WAIT = ("compute", "collective")  # where a rank waiting for another spends its stalled step


def find_stalls(lanes: list[Recording], warmup_steps: int, snapshots: list[dict], origin: float,
                suspended: list[tuple[float, float]] = ()) -> list[dict]:
    """The job's stalls, longest first: long steps of the processes that trained, the ranks'
    overlapping ones taken as one stall, each with who stalled and where (from the hang watch's
    snapshot taken during it, when there is one). `origin`: the job's time zero; `suspended`: when
    the user stopped the job (Ctrl-Z) - a step that spans such a time stood still by the user's will."""
    long_steps = [(rec, s) for rec in trainers(lanes) for s in _long_steps(rec, warmup_steps)
                  if not any(s["t0"] < until and s["t1"] > since for since, until in suspended)]
    stalls = []
    for group in _overlapping(long_steps):
        t0, t1 = min(s["t0"] for _, s in group), max(s["t1"] for _, s in group)
        snapshot = next((x for x in snapshots if x.get("since_t") is not None and t0 - 1.0 <= x["since_t"] <= t1), None)
        stalls.append({**_describe(group, snapshot), "at_s": round(min(s["t0"] for _, s in group) - origin, 3)})
    return sorted(stalls, key=lambda s: s["seconds"], reverse=True)[:MAX_SHOWN]


def _long_steps(rec: Recording, warmup_steps: int) -> list[dict]:
    """Steps far longer than the median of the detailed ones; after the detailed window, each
    block's longest step stands for the block."""
    # a step torch.compile compiled in is long for a reason of its own (analyze/compiled.py)
    steps = [s for s in rec.steps if s["i"] >= warmup_steps and not s.get("profiled") and not s["excl"].get("compile")]
    if len(steps) < 3:
        return []
    median = statistics.median(step_seconds(s) for s in steps)
    limit = max(STALL_FACTOR * median, MIN_STALL_S)
    longest = [b["longest"] for b in rec.blocks if b.get("longest")]
    # a step mostly spent starting a pass over a DataLoader (its workers) is long for a reason of its
    # own too (analyze/process.py: restarts)
    return [s for s in steps + longest if step_seconds(s) >= limit
            and s.get("counts", {}).get(PASS_START_COUNT, 0.0) < 0.5 * step_seconds(s)]


def _overlapping(long_steps: list[tuple[Recording, dict]]) -> list[list[tuple[Recording, dict]]]:
    """Long steps of different processes that overlap in time: one stall of the job."""
    groups: list[list[tuple[Recording, dict]]] = []
    for rec, s in sorted(long_steps, key=lambda x: x[1]["t0"]):
        if groups and s["t0"] < max(x[1]["t1"] for x in groups[-1]):
            groups[-1].append((rec, s))
        else:
            groups.append([(rec, s)])
    return groups


def _describe(group: list[tuple[Recording, dict]], snapshot: dict | None) -> dict:
    # who stalled: the long step most spent on its own work, not waiting for another process ...
    culprit_rec, culprit_step = max(group, key=lambda x: sum(v for k, v in x[1]["excl"].items() if k not in _WAIT))
    answers = {a["pid"]: a for a in (snapshot or {}).get("ranks", [])}
    outside = [a for a in answers.values() if not a.get("collective")]
    if outside and any(a.get("collective") for a in answers.values()):  # ... unless the watch saw whom they wait for
        culprit_rec, culprit_step = next(((r, s) for r, s in group if r.pid == outside[0]["pid"]),
                                         (culprit_rec, culprit_step))
    seconds = max(step_seconds(s) for _, s in group)
    answer = answers.get(culprit_rec.pid)
    waiting = [r for r, _ in group if r is not culprit_rec]
    return {
        "who": process_name(culprit_rec.rank, culprit_rec.pid), "rank": culprit_rec.rank, "pid": culprit_rec.pid,
        "step": culprit_step["i"],
        "seconds": round(seconds, 3), "t0": min(s["t0"] for _, s in group), "t1": max(s["t1"] for _, s in group),
        "median_step_s": round(statistics.median(step_seconds(s) for s in culprit_rec.steps), 6),
        "spent_in": max(culprit_step["excl"], key=culprit_step["excl"].get),
        "where": line_of(answer) if answer else None,
        "seen": [rank_line(a) for a in answers.values()],
        "waiting": [process_name(r.rank, r.pid) for r in waiting],
    }


def stall_finding(stall: dict, run_seconds: float) -> dict:
    evidence = (f"{stall['who']} stood still for {stall['seconds']:.1f} s in step {stall['step']}, {stall['at_s']:.1f} s "
                f"into the run (its median step: {stall['median_step_s'] * 1e3:.1f} ms), in "
                f"{PHASE_NAMES[stall['spent_in']]}")
    if stall["waiting"]:
        evidence += f"; {', '.join(stall['waiting'])} waited for it"
    if stall["seen"]:
        evidence += "; seen during it: " + "; ".join(stall["seen"])
    f = finding("stall", stall["seconds"] / run_seconds if run_seconds > 0 else 1.0, evidence, stall["where"], fix=(
        "see what that line waits for: I/O (a slow or network filesystem, a download), work one rank does alone "
        "(a checkpoint, an evaluation, logging: the others wait in their next collective - share it out, or do "
        "it in a background thread), a lock, a debugger; `py-spy dump --pid PID` while it stands still shows "
        "the native stack too"), share_of="the training time")
    if stall["rank"] is not None:
        f["rank"] = stall["rank"]
    return f
