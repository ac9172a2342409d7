"""The cross-rank rules: a job of several ranks judged as a whole - a straggler, ranks that ran
unequal numbers of steps, a job bound by communication."""

from __future__ import annotations

import copy
import statistics

from gpulab.monitor.analyze.findings import MIN_SHARE, add_support, finding, hottest
from gpulab.monitor.analyze.step_costs import PHASE_NAMES, StepCosts, select_steady
from gpulab.monitor.events import Recording, trainers

RANK_FIXES = {
    "data_wait": "make its input as fast as the others': the same DataLoader settings on every rank, "
                 "its slow samples cheaper (decode once and cache), or more workers where cores are spare",
    "sync": "remove the per-step host syncs on that rank (.item(), print(tensor), .cpu()): read values every N steps",
    "h2d": "copy from pinned memory without waiting on that rank: pin_memory=True and .to(device, non_blocking=True)",
    "other": "move that rank's extra per-step Python out of the loop (logging, metrics, checks every N steps)",
}


def rank_findings(lanes: list[Recording], warmup_steps: int, until: float | None = None) -> list[dict]:
    """Findings about a multi-rank job as a whole. `until`: when a process failed; only the steps
    before it are judged (after it the survivors wait for the dead, and their counts differ by the
    failure, not by their data).

    With synchronous data parallelism every rank waits for the slowest at each collective (DDP:
    inside backward), so step times come out equal and a straggler shows in *what* its step is
    made of: more time than the others in one host-side phase, while theirs grows in compute."""
    ranks = [r for r in trainers(lanes) if r.rank is not None]
    if until is not None:
        ranks = [_before(r, until) for r in ranks]
    ranks = [r for r in ranks if r.steps]
    if len(ranks) < 2:
        return []
    findings = []
    counts = {r.rank: r.steps_done for r in ranks}
    if len(set(counts.values())) > 1 and until is None:
        listing = ", ".join(f"rank {k}: {v}" for k, v in counts.items())
        most, least = max(counts.values()), min(counts.values())
        unequal = finding(
            "unbalanced_data", (most - least) / most, f"the ranks ran different numbers of steps ({listing}): in a "
            f"synchronous job the ranks with more batches wait in a collective for ranks that have stopped (a hang "
            f"until the timeout)", None,
            fix="give every rank the same number of batches: DistributedSampler(drop_last=True), or the same "
                "global batches split per rank (gpulab train does this)", share_of="steps")  # only some ranks ran
        unequal["support"] = f"the step counts of {len(ranks)} ranks"
        findings.append(unequal)
    steps = {r.rank: StepCosts(select_steady(r.steps, warmup_steps)[0] or r.steps) for r in ranks}
    seconds = statistics.median(s.seconds for s in steps.values())
    worst = None
    for category in RANK_FIXES:  # the host-side phases
        values = {k: s.mean[category] for k, s in steps.items()}
        rank = max(values, key=values.get)
        others = statistics.median(v for k, v in values.items() if k != rank)
        excess = values[rank] - others
        if worst is None or excess > worst[0]:
            worst = (excess, category, rank, others)
    excess, category, rank, others = worst
    if seconds <= 0:
        return findings
    if excess / seconds < MIN_SHARE:  # no rank is late: is every rank waiting on the network instead?
        comm = _communication_bound(ranks, steps, seconds)
        return findings + ([comm] if comm else [])
    lane = next(r for r in ranks if r.rank == rank)
    waiting = [k for k in steps if k != rank]
    extra_wait = (statistics.median(steps[k].compute + steps[k].collectives for k in waiting)
                  - (steps[rank].compute + steps[rank].collectives))
    evidence = (f"rank {rank} spends {excess * 1e3:.1f} ms more per step in {PHASE_NAMES[category]} than the other "
                f"ranks ({steps[rank].mean[category] * 1e3:.1f} ms vs a median of {others * 1e3:.1f} ms; "
                f"{excess / seconds:.0%} of the {seconds * 1e3:.1f} ms step)")
    if extra_wait > 0:
        several = len(waiting) > 1
        evidence += (f"; rank{'s' if several else ''} {', '.join(map(str, waiting))} wait{'' if several else 's'} "
                     f"for it: {extra_wait * 1e3:.1f} ms more per step in compute and collectives, where the gradient "
                     f"allreduce is waited for")
    where = hottest(lane, category)
    straggler = finding("straggler", excess / seconds, evidence, where,
                        fix=f"rank {rank} holds every rank back: " + RANK_FIXES[category])
    straggler["rank"] = rank
    add_support(lane, steps[rank], straggler)
    findings.append(straggler)
    return findings


def _before(rec: Recording, until: float) -> Recording:
    """The process as recorded up to `until`: its steps that ended by then."""
    early = copy.copy(rec)
    early.steps = [s for s in rec.steps if s["t1"] <= until]
    return early


# Every rank spends at least this share of its step in collectives, and none is late: the job is
# bound by communication rather than by one rank (below it, communication is a cost, not the cause).
COMM_BOUND_SHARE = 0.25


def _communication_bound(ranks: list[Recording], steps: dict[int, StepCosts], seconds: float) -> dict | None:
    shares = {k: s.collectives / s.seconds for k, s in steps.items() if s.seconds > 0}
    if not shares or min(shares.values()) < COMM_BOUND_SHARE:
        return None
    share = statistics.median(shares.values())
    listing = ", ".join(f"rank {k} {v:.0%}" for k, v in sorted(shares.items()))
    evidence = (f"every rank spends a large part of its step in collectives ({listing} of a {seconds * 1e3:.1f} ms "
                f"step) and none is late (no rank spends {MIN_SHARE:.0%} of the step more than the others in any host-side "
                f"phase): the gradients' allreduce itself is the cost")
    busiest = max(ranks, key=lambda r: steps[r.rank].collectives)
    bound = finding("communication_bound", share, evidence, hottest(busiest, "collective"), fix=(
        "communicate less per sample: a larger per-rank batch, or several micro-batches per allreduce (gradient "
        "accumulation with DDP's no_sync(), gpulab train --accumulate N); larger buckets so fewer, bigger messages "
        "(DDP(bucket_cap_mb=...)); bf16/fp16 gradient compression (DDP comm hooks) - or fewer ranks, when one "
        "machine's link is the limit (measure it: gpulab bench allreduce)"))
    bound["support"] = f"the collective share of {len(shares)} ranks"
    return bound
