"""CPU contention: the job's threads waiting for a core, from the sampler's running totals
(sampler.CoreReader: each thread's run-queue wait, the job's usable cores, the machine's CPUs).

A thread with work but no core waits on a run queue: the job runs more threads than it has cores
(torch's intra-op threads, DataLoader workers), or other processes use the same cores. For torch's
compute it costs more than its share: the OpenMP threads of a parallel op meet at its end, so one
thread without a core holds the others (docs/profiling.md has a measurement).

The wait share, and when the cores count as contended: gpulab.host.CoreWait, the rule gpulab
train's warning uses too.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gpulab.host import CoreWait
from gpulab.monitor.analyze.findings import FIXES, finding

# The samples inside the steady steps must span this long (5 intervals at the default 0.1 s).
MIN_SECONDS = 0.5


@dataclass
class CoreUse:
    """How the job used its cores over a window of samples."""

    wait: CoreWait  # the job's threads: busy ones, ran, waited; other processes' use of the same cores
    pressure: float | None  # the share of the time some task of the machine waited for a core (PSI)
    children_cores: float | None = None  # cores the training process's children kept busy (its DataLoader workers)

    @property
    def job_cores(self) -> float:
        """Cores the job's threads kept busy, on average."""
        return self.wait.ran_s / self.wait.seconds

    @property
    def idle_cores(self) -> float:
        return max(0.0, self.wait.cores - self.job_cores - self.wait.others_cores)

    def summary(self) -> dict:
        """For report.json."""
        w = self.wait
        numbers = {"seconds": w.seconds, "cores": w.cores, "job_cores": self.job_cores, "threads_with_work": w.demand,
                   "wait_share": w.share, "others_cores": w.others_cores, "busy_threads": w.busy_threads,
                   "pressure": self.pressure, "contended": w.contended}
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in numbers.items()}


def core_use(samples: list[dict], window: tuple[float, float] | None) -> CoreUse | None:
    """The job's use of its cores over `window` (the steady steps), from the samples inside it;
    None without samples, or when they span less than MIN_SECONDS: a shorter measurement is
    mostly of the moments around the steps (a short DDP job's took in the ranks' start-up)."""
    rows = [s for s in samples if s.get("cores") and (window is None or window[0] <= s["t"] <= window[1])]
    if len(rows) < 2 or rows[-1]["t"] - rows[0]["t"] < MIN_SECONDS:
        return None
    first, last = rows[0]["cores"], rows[-1]["cores"]
    seconds = rows[-1]["t"] - rows[0]["t"]
    ran, waited, busy_ran, busy_waited = (last[k] - first[k]
                                          for k in ("ran_s", "waited_s", "busy_ran_s", "busy_waited_s"))
    if ran + waited <= 0:
        return None
    others = max(0.0, last["cores_busy_s"] - first["cores_busy_s"] - ran)
    pressure = (last["pressure_s"] - first["pressure_s"]) / seconds if last["pressure_s"] is not None else None
    busy_threads = statistics.median(s["cores"]["busy_threads"] for s in rows[1:])  # each of the intervals
    children = [s["proc"]["workers_cpu_pct"] / 100 for s in rows if s.get("proc")]
    return CoreUse(
        wait=CoreWait(seconds, last["cores"], busy_threads, ran, waited, busy_ran, busy_waited, others),
        pressure=min(max(pressure, 0.0), 1.0) if pressure is not None else None,
        children_cores=statistics.mean(children) if children else None,
    )


def contention_finding(use: CoreUse | None, torch_threads: int, workers: int,
                       device_idle_share: float | None) -> dict | None:
    """`cpu_contention` when the cores are contended. Its share: the wait share (on a CPU run the
    compute stood still that long); on a GPU run no more than the device's idle share, since a host
    that waits while the device is busy costs nothing."""
    if use is None or not use.wait.contended:
        return None
    share = use.wait.share if device_idle_share is None else min(use.wait.share, device_idle_share)
    return finding("cpu_contention", share, contention_text(use, torch_threads, workers), None,
                   fix=contention_fix(use, torch_threads, workers))


def contention_text(use: CoreUse, torch_threads: int, workers: int) -> str:
    w = use.wait
    who = f"torch's {torch_threads} compute thread(s)" + (f", {workers} DataLoader worker(s)" if workers else "")
    text = (f"your busy threads waited for a core {w.share:.0%} of the step (run-queue wait, /proc schedstat); "
            f"{round(w.busy_threads)} busy thread(s) on {w.cores} usable core(s) ({who}); other processes used "
            f"{w.others_cores / w.cores:.0%} of those cores")
    if use.pressure is not None:
        text += f"; CPU pressure {use.pressure:.0%} (some task of the machine waited for a core)"
    return text


def contention_fix(use: CoreUse, torch_threads: int, workers: int) -> str:
    """The thread count to use, how to set it and how to measure it, then the general fix."""
    n = use.wait.threads_to_try(torch_threads, workers)
    parts = []
    if torch_threads > 1:
        parts.append(f"torch.set_num_threads({n}) at the start of the script (or OMP_NUM_THREADS={n})")
    if workers:
        parts.append(f"fewer DataLoader workers than {workers}")
    if not parts:
        return FIXES["cpu_contention"]
    fix = f"{' and '.join(parts)}, so that every busy thread has a core"
    if torch_threads > 1:
        fix += f" - measure it: gpulab profile --try threads={n} --steps 30 -- ..."
    return f"{fix}; in general: {FIXES['cpu_contention']}"
