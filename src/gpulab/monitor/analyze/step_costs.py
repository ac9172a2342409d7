"""Steps -> the steady steps (no warm-up, no measurement windows, no compiling, no epoch-boundary
outliers) -> what a steady step is made of, on average (StepCosts):

    seconds = data_wait    waiting for the next batch
            + copies       host->device copies
            + compute      host time in forward, backward and the optimizer
            + collectives  waiting in collectives
            + syncs        blocked in host syncs
            + compiling    torch.compile compiling
            + other        the user's Python between those calls

A forward written with torch functions rather than nn.Modules runs in "other"; where the
operators window found the lines whose time is such operators (record/probes/ops.py), their
share of "other" counts as compute in every steady step, and their stack samples as compute's
(operators_as_compute).
"""

from __future__ import annotations

import statistics

from gpulab.monitor.config import OUTLIER_FACTOR
from gpulab.monitor.events import BINS_PER_OCTAVE, CATEGORIES, OPS_SPAN, Recording, added

# The categories in the report's order, as the terminal names them.
PHASE_NAMES = {
    "data_wait": "data wait", "compute": "compute", "collective": "collectives", "sync": "host syncs", "h2d": "copies",
    "compile": "compiling", "other": "other Python",
}


def step_seconds(step: dict) -> float:
    return step["t1"] - step["t0"]


def recorded_seconds(rec: Recording) -> float:
    """From the recorder's start to its end (a process that died: to the end of its last step)."""
    if not rec.t_start:
        return 0.0
    ends = [s["t1"] for s in rec.steps[-1:]] + [b["t1"] for b in rec.blocks[-1:]]
    ends += [x["t1"] for x in (rec.tail,) if x] + [x["t"] for x in (rec.end,) if x]
    return max(ends, default=rec.t_start) - rec.t_start


def select_steady(steps: list[dict], warmup_steps: int) -> tuple[list[dict], dict]:
    """The steps that represent the loop, and how many were left out for each reason (steps
    torch.compile compiled in: analyze/compiled.py says what those cost)."""
    unprofiled = [s for s in steps if not s.get("profiled")]
    loop = [s for s in unprofiled if not s["excl"].get("compile", 0.0)] or unprofiled
    after_warmup = [s for s in loop if s["i"] >= warmup_steps]
    candidates = after_warmup or loop or list(steps)  # a very short run: use what there is
    if not candidates:
        return [], {"warmup": 0, "profiler_window": 0, "compiling": 0, "outliers": 0}
    median = statistics.median(step_seconds(s) for s in candidates)
    steady = [s for s in candidates if step_seconds(s) <= OUTLIER_FACTOR * median]
    return steady, {
        "warmup": len(loop) - len(after_warmup) if after_warmup else 0,
        "profiler_window": len(steps) - len(unprofiled),
        "compiling": len(unprofiled) - len(loop),
        "outliers": len(candidates) - len(steady),
    }


def aggregate_summary(rec: Recording) -> dict | None:
    """The steps after the detailed window (record/blocks.py), summed: how many, their median and
    p90 step time (from the histogram: within 5%), and what they were made of."""
    blocks = [b for b in rec.blocks if b["n"] > b["profiled"]]
    if not blocks:
        return None
    histogram: dict[int, int] = {}
    for b in blocks:
        for k, v in b["durations"].items():
            histogram[int(k)] = histogram.get(int(k), 0) + v
    excl = {c: sum(b["excl"].get(c, 0.0) for b in blocks) for c in CATEGORIES}
    total = sum(excl.values())
    return {
        "steps": sum(b["n"] for b in blocks), "from_step": blocks[0]["i0"], "to_step": blocks[-1]["i1"],
        "median_step_s": round(_histogram_quantile(histogram, 0.5), 6),
        "p90_step_s": round(_histogram_quantile(histogram, 0.9), 6),
        "phases": {c: round(v / total, 4) if total > 0 else 0.0 for c, v in excl.items()},
        "source": "summed per block of >= 1000 steps; step times from a histogram with bins 9% wide",
    }


def _histogram_quantile(histogram: dict[int, int], q: float) -> float:
    """The q-quantile of a step-time histogram, as its bin's geometric middle."""
    total, seen = sum(histogram.values()), 0
    for k in sorted(histogram):
        seen += histogram[k]
        if seen >= q * total:
            return 2 ** ((k + 0.5) / BINS_PER_OCTAVE)
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def shown_phases(shares: dict[str, float]) -> list[tuple[str, float]]:
    """The phases worth a word in a one-line summary: collectives and compiling only in a job that had any."""
    return [(name, value) for name, value in shares.items() if name not in ("collective", "compile") or value > 0]


def phases_text(shares: dict[str, float], sep: str = "  ") -> str:
    """"data wait 12%  compute 80%  ...": the shown phases in one line."""
    return sep.join(f"{PHASE_NAMES[name]} {value:.0%}" for name, value in shown_phases(shares))


def operators_as_compute(rec: Recording) -> tuple[float, list[str]]:
    """(the share of "other" that is torch operators called outside any module, the lines whose
    time is mostly theirs), those lines' stack samples moved from "other" to "compute" - once per
    recording, which keeps the answer: every reader of it (the report, each lane's summary) sees
    the same split."""
    if rec.operators is None:
        lines = _operator_lines(rec)
        rec.operators = (_operator_share(rec, lines), lines)
        compute = rec.hot.setdefault("compute", {})
        for where in lines:
            for tally in (rec.hot_steps, rec.hot_blocked):
                (tally.get("other") or {}).pop(where, None)
            seconds = (rec.hot.get("other") or {}).pop(where, None)
            if seconds is not None:
                compute[where] = compute.get(where, 0.0) + seconds
    return rec.operators


def _operator_lines(rec: Recording) -> list[str]:
    """The lines whose operators window's seconds (a window step) are at least half of their
    stack samples in "other" (a step of the run); a line that computes in Python around its
    operators stays."""
    window = len(rec.facts.get("ops_window_steps") or ())
    sampled = rec.hot.get("other") or {}
    steps = max(1, rec.steps_done)
    return [where for where, seconds in (rec.facts.get("ops_lines") or {}).items()
            if window and seconds / window >= sampled.get(where, 0.0) / steps / 2]


def _operator_share(rec: Recording, lines: list[str]) -> float:
    """The larger of two measures, each short in its own way: the window's operators against the
    rest of its "other" (its profile function slows the Python around the operators), and the
    stack samples of `lines` against all of "other"'s (a sample after a long call can land on the
    next line, in "other")."""
    if not lines:
        return 0.0
    window = set(rec.facts["ops_window_steps"])
    operators = rec.span_seconds.get(OPS_SPAN, 0.0)
    other = sum(s["excl"].get("other", 0.0) for s in rec.steps if s.get("i") in window)
    sampled = rec.hot.get("other") or {}
    return max(operators / (operators + other) if operators > 0 else 0.0,
               sum(sampled.get(where, 0.0) for where in lines) / sum(sampled.values()) if sampled else 0.0)


class StepCosts:
    """Mean seconds per steady step of each part of the sum above, by category (`mean`) and by name
    (DDP's wait for its allreduce inside backward is a collective already: record/probes/ddp.py).
    `operator_share`: the share of "other" that is compute (operators_as_compute())."""

    def __init__(self, steady: list[dict], operator_share: float = 0.0):
        self.n = n = len(steady)
        self.seconds = sum(step_seconds(s) for s in steady) / n
        self.operator_share = operator_share
        self.operators = sum(s["excl"].get("other", 0.0) for s in steady) / n * operator_share  # seconds a step
        self.mean = {c: sum(self._excl(s, c) for s in steady) / n for c in CATEGORIES}
        self.data_wait, self.copies, self.compute, self.collectives, self.syncs, self.compiling, self.other = (
            self.mean[c] for c in ("data_wait", "h2d", "compute", "collective", "sync", "compile", "other"))
        self.counts = {k: v / n for k, v in added({}, *(s.get("counts", {}) for s in steady)).items()}
        self._steady = steady

    def share_by_quarter(self, category: str) -> list[float]:
        """The share of `category` in each quarter of the steady steps, in order (the whole, with
        fewer than 8 steps): on a busy machine a share moves from quarter to quarter about as much
        as from run to run."""
        steady, n = self._steady, len(self._steady)
        parts = [steady[j * n // 4:(j + 1) * n // 4] for j in range(4)] if n >= 8 else [steady]
        shares = []
        for part in parts:
            seconds = sum(step_seconds(s) for s in part)
            shares.append(sum(self._excl(s, category) for s in part) / seconds if seconds > 0 else 0.0)
        return shares

    def _excl(self, step: dict, category: str) -> float:
        """A step's seconds of `category`, with the operators' share of "other" taken as compute."""
        excl = step["excl"]
        operators = excl.get("other", 0.0) * self.operator_share
        if category == "other":
            return excl.get("other", 0.0) - operators
        if category == "compute":
            return excl.get("compute", 0.0) + operators
        return excl.get(category, 0.0)

    def shares(self) -> dict[str, float]:
        return {c: round(self.mean[c] / self.seconds, 4) if self.seconds > 0 else 0.0 for c in PHASE_NAMES}


def steps_found(rec: Recording) -> str:
    """How the steps were found, or why there are none, in words."""
    rule = rec.step_rule
    if rule == "optimizer":
        return "found from optimizer.step()"
    if rule == "backward":
        return "found from backward() calls: no torch.optim optimizer was stepped"
    if rule == "explicit":
        return "marked with p.step()"
    if not rec.recorded:
        return "the process never imported torch"
    if rec.steps_done:  # steps were recorded, but not the rule that found them (the process died first)
        return "found before the process ended; how was not written"
    if rec.facts.get("backward_calls") == 0 and rec.facts.get("optimizer_steps") == 0:
        if not rec.span_seconds:
            return "nothing ran: torch was imported, but no model, DataLoader or backward() was called"
        return "no training at all - no backward() and no optimizer.step(): an inference-only run"
    return "the script ended (or failed) before its first backward() or optimizer.step()"


def lane_summary(rec: Recording, warmup_steps: int) -> dict:
    """One process of the job in a few numbers: steps, how they were found, step time, phase shares."""
    steady, _ = select_steady(rec.steps, warmup_steps)
    summary = {"pid": rec.pid, "ppid": rec.start.get("ppid") or rec.process.get("ppid"), "rank": rec.rank,
               "steps": rec.steps_done, "steps_found": steps_found(rec), "median_step_s": None, "phases": None}
    if steady:
        summary["median_step_s"] = round(statistics.median(step_seconds(s) for s in steady), 6)
        summary["phases"] = StepCosts(steady, operators_as_compute(rec)[0]).shares()
    return summary
