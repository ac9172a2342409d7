"""From a recording to a diagnosis: where the step time goes, and which cause is eating it.

The model (per steady-state step, all times in seconds):

    S  step time                     D  waiting for data         H  host->device copies
    C  host time in forward/backward/optimizer                   Y  blocked in host syncs
    O  other: the user's Python between those calls              S = D + H + C + Y + O
    B  time the *device* was busy    (CPU: B = C, the CPU is the device;
                                      CUDA: kernel-window busy time, else NVML kernel-active share x S)
    I  device idle = S - B           A  host active = S - Y - H (not blocked on the device)

On CUDA the host normally runs ahead of the device, so host-side costs are free while the device
has queued work. What a fix can save is therefore bounded by the device's idle time:

    host_sync, h2d_copy     min(Y or H, I)    removing the wait lets the host run ahead
    input_pipeline          min(D, E)         E = max(0, A - B): host work the device cannot hide
    launch_overhead         min(C, E)         when the kernel window shows many tiny kernels
    low_device_utilization  min(O, E)         Python between the training calls

On the CPU everything is serial (I = S - C, E = D + O) and the shares are the plain fractions of
the step. A finding is reported when its share is at least MIN_SHARE; a fast input pipeline in a
compute-bound loop therefore gets no `input_pipeline` finding. Findings are ranked by share;
"none" stands alone when nothing stands out.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from gpulab.monitor.events import CATEGORIES, TRANSFORM_PREFIX, Recording, trainers

PHASE_NAMES = {
    "data_wait": "data wait", "compute": "compute", "collective": "collectives", "sync": "host syncs", "h2d": "copies", "other": "other Python",
}
MIN_SHARE = 0.10
OUTLIER_FACTOR = 10.0  # a step 10x the median is an epoch boundary (evaluation, checkpoint), not a step
TINY_KERNEL_US = 20.0  # kernels this short cost about as much to launch as to run
MANY_KERNELS_PER_STEP = 20

FIXES = {
    "input_pipeline_cheaper": (
        "make each sample cheaper - decode once and cache the decoded data, turn per-sample transforms "
        "into batch-level ones on the device - or, if the dataset fits in device memory, keep it there "
        "and slice batches on the device (gpulab.data.DeviceLoader does this)"
    ),
    "input_pipeline_restart": (
        "the DataLoader starts its worker processes again every epoch: pass persistent_workers=True"
    ),
    "host_sync": (
        "keep running values on the device (total += loss.detach()) and read them every N steps or once "
        "per epoch; avoid .item(), print(tensor), .cpu(), float(t) and `if tensor:` inside the step"
    ),
    "h2d_copy": (
        "copy from pinned memory without waiting: DataLoader(pin_memory=True) and "
        "x.to(device, non_blocking=True); better still, keep the dataset on the device"
    ),
    "h2d_copy_pinned": (
        "the memory is pinned already: add non_blocking=True to the copy (x.to(device, non_blocking=True)) "
        "so the host queues it and runs ahead; better still, keep the dataset on the device"
    ),
    "launch_overhead": (
        "give each kernel more work or launch fewer: a larger batch, fuse the small ops with "
        "torch.compile, or replay the step as a CUDA graph (torch.compile(mode='reduce-overhead')); "
        "replace Python loops over samples with vectorized indexing, and per-sample loops over "
        "variable-size inputs with pad-and-mask"
    ),
    "low_device_utilization": (
        "move per-step Python out of the loop: vectorize it with tensor indexing instead of Python "
        "loops, do logging and metrics every N steps, or move preprocessing into DataLoader workers"
    ),
    "cpu_only_build": (
        "install a CUDA build of torch (pip install torch --index-url "
        "https://download.pytorch.org/whl/cu126, matching `nvidia-smi`), then move the model and "
        "batches to the GPU"
    ),
    "cpu_only_placement": (
        "put the work on the GPU: model.to('cuda') and x.to('cuda', non_blocking=True) for each "
        "batch (or keep the whole dataset on the GPU)"
    ),
    "no_steps": (
        "let the script reach its training loop: steps are found from optimizer.step(), else from "
        "backward() calls (with the Python API, mark them with p.step())"
    ),
    "none": (
        "the loop keeps the device busy; to go faster make the math cheaper (mixed precision, "
        "channels_last, torch.compile) or use more devices (gpulab train --devices ...)"
    ),
}


# ----------------------------------------------------------------------------- steps


def step_seconds(step: dict) -> float:
    return step["t1"] - step["t0"]


def select_steady(steps: list[dict], warmup_steps: int) -> tuple[list[dict], dict]:
    """Steps that represent the loop: warm-up, the kernel window and epoch-boundary outliers excluded."""
    unprofiled = [s for s in steps if not s.get("profiled")]
    after_warmup = [s for s in unprofiled if s["i"] >= warmup_steps]
    candidates = after_warmup or unprofiled or list(steps)  # a very short run: use what there is
    if not candidates:
        return [], {"warmup": 0, "profiler_window": 0, "outliers": 0}
    median = statistics.median(step_seconds(s) for s in candidates)
    steady = [s for s in candidates if step_seconds(s) <= OUTLIER_FACTOR * median]
    return steady, {
        "warmup": len(unprofiled) - len(after_warmup) if after_warmup else 0,
        "profiler_window": len(steps) - len(unprofiled),
        "outliers": len(candidates) - len(steady),
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# ----------------------------------------------------------------------------- devices


def _used_gpu_indices(rec: Recording, gpus: list[dict]) -> list[int]:
    """NVML indices of the GPUs the script allocated memory on (matched by UUID)."""
    used = (rec.end or {}).get("cuda", {}).get("devices", [])
    torch_uuids = {d["uuid"].removeprefix("GPU-") for d in used if d.get("uuid")}
    indices = [g["index"] for g in gpus if g.get("uuid", "").removeprefix("GPU-") in torch_uuids]
    if used and not indices:  # UUIDs unavailable: assume torch's first GPUs are NVML's visible ones
        indices = [g["index"] for g in gpus[: len(used)]]
    return indices


def _samples_between(samples: list[dict], t0: float, t1: float) -> list[dict]:
    inside = [s for s in samples if t0 <= s["t"] <= t1]
    return inside or samples


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize_devices(samples: list[dict], gpus: list[dict], used: list[int], window, start: dict) -> list[dict]:
    """Per GPU: mean and max of every sampled metric over the steady window; then the process."""
    chosen = _samples_between(samples, *window) if window else samples
    out = []
    for position, info in enumerate(gpus):
        rows = [s["gpus"][position] for s in chosen if len(s["gpus"]) > position]
        metrics = sorted({k for r in rows for k, v in r.items() if v is not None})
        out.append({
            "kind": "gpu",
            **{k: info[k] for k in ("index", "name", "uuid", "memory_total_mib", "gpm")},
            "used_by_script": info["index"] in used,
            "mean": {m: _round(_mean(r.get(m) for r in rows)) for m in metrics},
            "max": {m: _round(max((r[m] for r in rows if r.get(m) is not None), default=None)) for m in metrics},
        })
    procs = [s["proc"] for s in chosen if s.get("proc")]
    out.append({
        "kind": "cpu",
        "logical_cores": start.get("cpu_count"),
        "torch_threads": start.get("torch_threads"),
        "process_cpu_pct_mean": _round(_mean(p["cpu_pct"] for p in procs)),
        "process_cpu_pct_max": _round(max((p["cpu_pct"] for p in procs), default=None)),
        "process_rss_mib_max": _round(max((p["rss_mib"] for p in procs), default=None)),
        "threads_max": max((p["threads"] for p in procs), default=None),
        "workers_max": max((p["workers"] for p in procs), default=None),
        "workers_cpu_pct_mean": _round(_mean(p["workers_cpu_pct"] for p in procs)),
    })
    return out


def _round(x, digits: int = 3):
    return round(x, digits) if isinstance(x, float) else x


# ----------------------------------------------------------------------------- the diagnosis


def shown_phases(shares: dict[str, float]) -> list[tuple[str, float]]:
    """The phases worth a word in a one-line summary: collectives only in a job that had any."""
    return [(name, value) for name, value in shares.items() if name != "collective" or value > 0]


class _Step:
    """Mean seconds per steady step of each quantity in the model above.

    `ddp`: DDP's own runtime timers (recorder.ddp_runtime_stats). DDP waits for its gradient
    buckets inside backward, in C++, so the recorder sees that wait as compute; DDP measures the
    part of its allreduce not hidden behind the backward computation (at iterations it samples),
    and that mean moves from compute to collective."""

    def __init__(self, steady: list[dict], ddp: dict | None = None):
        n = len(steady)
        self.n = n
        total = {c: sum(s["excl"].get(c, 0.0) for s in steady) for c in CATEGORIES}
        self.S = sum(step_seconds(s) for s in steady) / n
        self.D, self.H, self.C, self.K, self.Y, self.O = (
            total[c] / n for c in ("data_wait", "h2d", "compute", "collective", "sync", "other"))
        counts: dict[str, float] = {}
        for s in steady:
            for k, v in s.get("counts", {}).items():
                counts[k] = counts.get(k, 0) + v
        self.counts = {k: v / n for k, v in counts.items()}
        self.ddp_exposed = min(ddp["exposed_comm_s"], self.C) if ddp else 0.0
        self.C -= self.ddp_exposed
        self.K += self.ddp_exposed

    def shares(self) -> dict[str, float]:
        values = {"data_wait": self.D, "compute": self.C, "collective": self.K, "sync": self.Y, "h2d": self.H,
                  "other": self.O}
        return {k: round(v / self.S, 4) if self.S > 0 else 0.0 for k, v in values.items()}


def diagnose(rec: Recording, samples: list[dict], gpus: list[dict], warmup_steps: int) -> dict:
    """The report's core: steps, step time, phase shares, device summaries and ranked findings."""
    steady, excluded = select_steady(rec.steps, warmup_steps)
    whole_run = False
    if not steady and rec.tail and rec.tail["t1"] > rec.tail["t0"]:
        # No optimizer step at all (it crashed first, or it is not a training loop): judge the run.
        steady, whole_run = [rec.tail], True
    used = _used_gpu_indices(rec, gpus)
    window = (steady[0]["t0"], steady[-1]["t1"]) if steady else None
    report = {
        "steps": len(rec.steps),
        "steps_found": steps_found(rec),
        "step_time_s": {"median": 0.0, "p90": 0.0},
        "phases": dict.fromkeys(("data_wait", "compute", "collective", "sync", "h2d", "other"), 0.0),
        "devices": summarize_devices(samples, gpus, used, window, rec.start),
        "findings": [],
        "steady_steps": 0 if whole_run else len(steady),
        "excluded_steps": excluded,
    }
    if not steady:
        report["findings"] = [_finding("none", 0.0, f"no training step was recorded: {steps_found(rec)}", None,
                                       "no_steps")]
        return report
    durations = [step_seconds(s) for s in steady]
    if not whole_run:
        median, p90 = statistics.median(durations), percentile(durations, 0.9)
        report["step_time_s"] = {"median": round(median, 6), "p90": round(p90, 6)}
    step = _Step(steady, rec.facts.get("ddp"))
    report["phases"] = step.shares()
    if step.K > 0:
        report["collectives"] = _collectives_summary(step, rec.facts.get("ddp"))
    busy, busy_source = _device_busy(rec, step, samples, gpus, used, window)
    report["device_busy"] = {"share": round(min(busy / step.S, 1.0), 4) if step.S else 0.0, "source": busy_source}
    findings = _findings(rec, step, busy, busy_source, gpus, used)
    if whole_run:
        for f in findings:
            f["evidence"] = f"no training step ({steps_found(rec)}), so these shares are of the whole run; " + f["evidence"]
    report["findings"] = findings
    report["transforms"] = costly_transforms(rec, step)
    return report


def costly_transforms(rec: Recording, step: "_Step") -> list[dict]:
    """Per-sample transforms run inside the fetch, costliest first: share of the step, where built."""
    sites = rec.facts.get("transforms") or {}
    ranked = []
    for key, seconds in step.counts.items():
        if key.startswith(TRANSFORM_PREFIX):
            name = key.removeprefix(TRANSFORM_PREFIX)
            ranked.append({"name": name, "share": round(seconds / step.S, 4) if step.S else 0.0,
                           "ms_per_step": round(seconds * 1e3, 3), "where": (sites.get(name) or {}).get("where")})
    return sorted(ranked, key=lambda t: t["share"], reverse=True)


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
    if rec.facts.get("backward_calls") == 0 and rec.facts.get("optimizer_steps") == 0:
        if not rec.span_seconds:
            return "nothing ran: torch was imported, but no model, DataLoader or backward() was called"
        return "no training at all - no backward() and no optimizer.step(): an inference-only run"
    return "the script ended (or failed) before its first backward() or optimizer.step()"


def lane_summary(rec: Recording, warmup_steps: int) -> dict:
    """One process of the job in a few numbers: steps, how they were found, step time, phase shares."""
    steady, _ = select_steady(rec.steps, warmup_steps)
    summary = {"pid": rec.pid, "ppid": rec.start.get("ppid") or rec.process.get("ppid"), "rank": rec.rank,
               "steps": len(rec.steps), "steps_found": steps_found(rec), "median_step_s": None, "phases": None}
    if steady:
        summary["median_step_s"] = round(statistics.median(step_seconds(s) for s in steady), 6)
        summary["phases"] = _Step(steady, rec.facts.get("ddp")).shares()
    return summary


def _device_busy(rec: Recording, step: _Step, samples, gpus, used, window) -> tuple[float, str]:
    """Seconds per step the device was busy, and how that was measured."""
    if not used:
        return step.C, "cpu"
    k = _kernel_window(rec)
    if k:
        return k["device_busy_s_per_step"], f"torch.profiler over {k['steps']} steps"
    chosen = _samples_between(samples, *window) if window else samples
    positions = [p for p, g in enumerate(gpus) if g["index"] in used]
    rows = [s["gpus"][p] for s in chosen for p in positions if p < len(s["gpus"])]
    # NVML's per-process SM share counts this job alone; the device-wide kernel-active share also
    # counts every other process on a shared GPU, so it is the fallback, and says so.
    util = _mean(r.get("process_sm_pct") for r in rows)
    if util is not None:
        return util / 100 * step.S, "NVML per-process SM share of this job's processes"
    util = _mean(r.get("kernel_active_pct") for r in rows)
    if util is not None:
        return util / 100 * step.S, "NVML kernel-active share, device-wide (other processes on the GPU count too)"
    return step.C, "unknown (no kernel window, no NVML): host compute time used instead"


@dataclass
class _Budget:
    """Per step: how long the device was busy and idle, and how much host work it cannot hide."""

    busy: float
    source: str
    on_cuda: bool
    idle: float
    sync_blocked: float
    exposed: float

    def idle_text(self, S: float) -> str:
        return f"; the device was idle {self.idle / S:.0%} of the step ({self.source})" if self.on_cuda else ""


def _budget(rec: Recording, step: _Step, busy: float, source: str, on_cuda: bool) -> _Budget:
    sync_blocked = step.Y
    k = _kernel_window(rec)
    if k:  # the window also saw syncs inside calls gpulab does not time
        sync_blocked = max(sync_blocked, k["runtime_sync_s_per_step"] - step.H)
    if on_cuda:
        host_active = step.S - sync_blocked - step.H
        exposed = max(0.0, host_active - busy)
    else:  # the CPU is the device: everything that is not compute is in its way
        exposed = step.D + step.O
    return _Budget(busy, source, on_cuda, max(0.0, step.S - busy), sync_blocked, exposed)


def _findings(rec: Recording, step: _Step, busy: float, busy_source: str, gpus: list[dict],
              used: list[int]) -> list[dict]:
    b = _budget(rec, step, busy, busy_source, on_cuda=bool(used))
    candidates = [_input_finding(rec, step, b), _other_finding(rec, step, b)]
    if b.on_cuda:
        candidates += [_sync_finding(rec, step, b), _h2d_finding(rec, step, b), _launch_finding(rec, step, b)]
    elif gpus:
        candidates.append(_cpu_only_finding(rec, step, gpus))
    findings = [f for f in candidates if f is not None and f["share"] >= MIN_SHARE]
    if b.on_cuda:
        findings += _unexplained_idle(rec, step, b, findings)
    findings.sort(key=lambda f: f["share"], reverse=True)
    findings = findings or [_nothing_stands_out(step, b)]
    for f in findings:
        _add_support(rec, step, f)
    return findings


MIN_LINE_SAMPLES = 5  # a line named from fewer stack samples than this is not named


def _add_support(rec: Recording, step: _Step, f: dict) -> None:
    """What the finding rests on: how many steps, and how the line was found (calls or samples)."""
    parts = [f"{step.n} steady steps"]
    where = f["where"]
    site = next((s for s in rec.sites if s["where"] == where), None) if where else None
    if site:
        parts.append(f"{site['count']} calls seen at that line")
    elif where:
        seen, total = max(((lines.get(where, 0), sum(lines.values())) for lines in rec.hot.values()), default=(0, 0))
        if seen:
            parts.append(f"the line from {seen} of {total} stack samples")
            if seen < MIN_LINE_SAMPLES:
                parts[-1] += " - too few to name it"
                f["where"] = None
    f["support"] = "; ".join(parts)


def _input_finding(rec: Recording, step: _Step, b: _Budget) -> dict:
    S = step.S
    loader = rec.loaders[0] if rec.loaders else None
    evidence = f"waited {step.D * 1e3:.1f} ms per step for the next batch ({step.D / S:.0%} of the step, {step.n} steps)"
    if loader:
        evidence += (f"; DataLoader(batch_size={loader['batch_size']}, num_workers={loader['num_workers']}, "
                     f"pin_memory={loader['pin_memory']})")
    transforms = [t for t in costly_transforms(rec, step) if t["share"] >= 0.02][:3]
    if transforms:
        evidence += "; per-sample transforms: " + ", ".join(
            f"{t['name']} {t['share']:.0%} of the step" + (f" at {t['where']}" if t["where"] else "") for t in transforms)
    restart = rec.span_seconds.get("DataLoader.__iter__", 0.0)
    waited = restart + rec.span_seconds.get("next(DataLoader)", 0.0)
    workers = loader["num_workers"] if loader else 0
    spare = _spare_cores(rec, b.on_cuda, workers)
    if loader and workers > 0 and not loader["persistent_workers"] and waited and restart > 0.3 * waited:
        fix = FIXES["input_pipeline_restart"]
        evidence += f"; {restart / waited:.0%} of it in starting the worker processes"
    elif spare >= 1:
        fix = (f"load batches in parallel: DataLoader(num_workers={workers + spare}, persistent_workers=True) - "
               f"{spare} core(s) are spare; check it: gpulab profile --try num_workers={workers + spare} --steps 30 -- ...; ")
        fix += FIXES["input_pipeline_cheaper"]
    else:
        # Measured on this project's 2-core VM: with torch's threads on every core one worker made
        # one data-bound script 1.96x faster and another 0.86x: no rule from the recording tells
        # which, so say what is known and how to measure it.
        cores = rec.start.get("cpu_count")
        users = "the trainer's own Python" if b.on_cuda else f"torch's {_torch_threads(rec)} compute thread(s)"
        fix = (f"more DataLoader workers are no sure win here: the {cores} cores are taken ({users}"
               f"{f', {workers} worker(s)' if workers else ''}), so workers would compete with the training for "
               f"them - measure before changing it: gpulab profile --try num_workers={workers + 1} --steps 30 -- ...; ")
        fix += FIXES["input_pipeline_cheaper"]
    if transforms:
        fix = (f"apply {transforms[0]['name']} once per batch (on the device), not per sample in __getitem__; " + fix)
    where = _hottest(rec, "data_wait") or (loader or {}).get("where")
    return _finding("input_pipeline", min(step.D, b.exposed) / S, evidence + b.idle_text(S), where, fix=fix)


def _spare_cores(rec: Recording, on_cuda: bool, workers: int) -> int:
    """Cores that DataLoader workers could use without taking them from the training itself.

    On the CPU the training's compute uses torch's intra-op threads; on a GPU the trainer's own
    Python needs about one core. Workers already running use one each. Under torchrun every
    rank on this machine (LOCAL_WORLD_SIZE) takes as much as this one, and would add as many
    workers: each gets its share of what is left."""
    cores = rec.start.get("cpu_count") or 1
    trainer = 1 if on_cuda else _torch_threads(rec)
    ranks_here = rec.start.get("local_world_size") or 1
    return max(0, cores - ranks_here * (trainer + workers)) // ranks_here


def _torch_threads(rec: Recording) -> int:
    """The training's intra-op threads, as last seen (scripts often set them after importing torch)."""
    return rec.facts.get("torch_threads") or rec.start.get("torch_threads") or 1


def _other_finding(rec: Recording, step: _Step, b: _Budget) -> dict:
    S = step.S
    evidence = (f"{step.O * 1e3:.1f} ms per step ({step.O / S:.0%}) is Python between the training calls "
                f"(outside data loading, forward, backward and the optimizer)")
    return _finding("low_device_utilization", min(step.O, b.exposed) / S, evidence + b.idle_text(S),
                    _hottest(rec, "other"), "low_device_utilization")


def _unexplained_idle(rec: Recording, step: _Step, b: _Budget, findings: list[dict]) -> list[dict]:
    """Device idle time that no specific cause accounts for."""
    S = step.S
    unexplained = b.idle / S - sum(f["share"] for f in findings)
    if unexplained < MIN_SHARE or any(f["cause"] == "low_device_utilization" for f in findings):
        return []
    evidence = (f"the device was busy only {b.busy / S:.0%} of each step ({b.source}); the host spent "
                f"{step.C * 1e3:.1f} ms per step issuing forward/backward/optimizer work and "
                f"{step.O * 1e3:.1f} ms elsewhere")
    where = _hottest(rec, "compute") or _hottest(rec, "other")
    return [_finding("low_device_utilization", unexplained, evidence, where, "low_device_utilization")]


def _nothing_stands_out(step: _Step, b: _Budget) -> dict:
    S = step.S
    parts = ", ".join(f"{PHASE_NAMES[name]} {value:.0%}" for name, value in shown_phases(step.shares()) if name != "compute")
    if b.on_cuda:
        head = f"the device was busy {min(b.busy / S, 1):.0%} of the step ({b.source})"
    else:
        head = f"compute takes {step.C / S:.0%} of the step"
    return _finding("none", min(b.busy / S, 1.0), f"{head}; {parts}: nothing else stands out", None, "none")


def _sync_finding(rec: Recording, step: _Step, b: _Budget) -> dict | None:
    sites = sorted((s for s in rec.sites if s["kind"] == "sync"), key=lambda s: (s["seconds"], s["count"]), reverse=True)
    if not sites and b.sync_blocked <= 0:
        return None
    per_step = step.counts.get("sync", 0) + step.counts.get("sync_untimed", 0)
    evidence = (f"{per_step:.1f} host syncs per step kept the host blocked {b.sync_blocked * 1e3:.1f} ms per step, "
                f"so the device could not run ahead while Python prepared the next step")
    if sites:
        top = sites[0]
        evidence += f"; top: {'/'.join(top['ops'])} at {top['where']} ({top['count']} calls, {top['seconds']:.2f} s)"
    where = sites[0]["where"] if sites else None
    return _finding("host_sync", min(b.sync_blocked, b.idle) / step.S, evidence + b.idle_text(step.S), where, "host_sync")


def _h2d_finding(rec: Recording, step: _Step, b: _Budget) -> dict | None:
    """Copies the host waited for: from pageable memory, or from pinned memory without
    non_blocking=True (pinning alone does not make a copy asynchronous)."""
    pageable = step.counts.get("h2d_pageable", 0)
    pinned_blocking = step.counts.get("h2d_pinned_blocking", 0)
    if not pageable and not pinned_blocking:
        return None
    kinds = ("h2d_pageable", "h2d_pinned_blocking")
    sites = sorted((s for s in rec.sites if s["kind"] in kinds), key=lambda s: s["seconds"], reverse=True)
    parts = []
    if pageable:
        mb = step.counts.get("h2d_pageable_bytes", 0) / 1e6
        parts.append(f"{pageable:.1f} host-to-device copies per step from pageable memory ({mb:.1f} MB)")
    if pinned_blocking:
        mb = step.counts.get("h2d_pinned_blocking_bytes", 0) / 1e6
        parts.append(f"{pinned_blocking:.1f} per step from pinned memory without non_blocking=True, so the "
                     f"host waited anyway ({mb:.1f} MB)")
    evidence = "; ".join(parts) + f", {step.H * 1e3:.1f} ms per step in the copy calls"
    where = sites[0]["where"] if sites else None
    fix = "h2d_copy" if pageable else "h2d_copy_pinned"
    return _finding("h2d_copy", min(step.H, b.idle) / step.S, evidence + b.idle_text(step.S), where, fix)


def _launch_finding(rec: Recording, step: _Step, b: _Budget) -> dict | None:
    k = _kernel_window(rec)
    if not k or k["kernel_median_us"] is None:
        return None
    if k["kernel_median_us"] > TINY_KERNEL_US or k["kernels_per_step"] < MANY_KERNELS_PER_STEP:
        return None
    evidence = (f"{k['kernels_per_step']:.0f} kernels per step, median {k['kernel_median_us']:.1f} us each; the "
                f"device was busy {b.busy * 1e3:.2f} ms of each {step.S * 1e3:.2f} ms step while the host spent "
                f"{step.C * 1e3:.2f} ms issuing forward/backward/optimizer work")
    share = min(step.C, b.exposed) / step.S
    return _finding("launch_overhead", share, evidence, _hottest(rec, "compute"), "launch_overhead")


def _cpu_only_finding(rec: Recording, step: _Step, gpus: list[dict]) -> dict:
    names = ", ".join(sorted({g["name"] for g in gpus}))
    if rec.start.get("torch_cuda_build") is None:
        evidence = f"torch {rec.start.get('torch')} is a CPU-only build while {len(gpus)} GPU(s) are present ({names})"
        fix = "cpu_only_build"
    else:
        evidence = f"torch can use the GPU ({names}) but the script never put work on it"
        fix = "cpu_only_placement"
    evidence += f"; the CPU computed for {step.C * 1e3:.1f} ms of each {step.S * 1e3:.1f} ms step"
    return _finding("cpu_only_torch", step.C / step.S, evidence, _hottest(rec, "compute"), fix)


def _kernel_window(rec: Recording) -> dict | None:
    return rec.kernels if rec.kernels and "error" not in rec.kernels else None


def _hottest(rec: Recording, category: str) -> str | None:
    lines = rec.hot.get(category) or {}
    return max(lines, key=lines.get) if lines else None


def _finding(cause: str, share: float, evidence: str, where: str | None, fix_key: str | None = None,
             fix: str | None = None) -> dict:
    return {
        "cause": cause,
        "share": round(min(max(share, 0.0), 1.0), 4),
        "evidence": evidence,
        "where": where,
        "fix": fix if fix is not None else FIXES[fix_key],
    }


# ----------------------------------------------------------------------------- across ranks


RANK_FIXES = {
    "data_wait": "make its input as fast as the others': the same DataLoader settings on every rank, "
                 "its slow samples cheaper (decode once and cache), or more workers where cores are spare",
    "sync": "remove the per-step host syncs on that rank (.item(), print(tensor), .cpu()): read values every N steps",
    "h2d": "copy from pinned memory without waiting on that rank: pin_memory=True and .to(device, non_blocking=True)",
    "other": "move that rank's extra per-step Python out of the loop (logging, metrics, checks every N steps)",
}


def _collectives_summary(step: _Step, ddp: dict | None) -> dict:
    summary = {"ms_per_step": round(step.K * 1e3, 3), "share": round(step.K / step.S, 4) if step.S else 0.0,
               "source": "torch.distributed calls and waits timed by gpulab"}
    if ddp:
        summary["ddp_backward_wait_ms_per_step"] = round(step.ddp_exposed * 1e3, 3)
        summary["ddp_allreduce_ms_per_step"] = round(ddp["avg_backward_comm_s"] * 1e3, 3)
        summary["ddp_overlapped_ms_per_step"] = round(ddp["avg_overlap_s"] * 1e3, 3)
        summary["source"] += ("; DDP's wait for its buckets inside backward from DDP's own timers (the mean over "
                              "the iterations DDP samples), moved from compute")
    return summary


def rank_findings(lanes: list[Recording], warmup_steps: int) -> list[dict]:
    """Findings about a multi-rank job as a whole: a straggler, and ranks that ran unequal steps.

    With synchronous data parallelism every rank waits for the slowest at each collective (for
    DDP: inside backward, where the allreduce is waited for), so step times come out equal and
    the straggler shows in *what* its step is made of: more time than the other ranks in one
    host-side phase, while theirs grows in compute (waiting)."""
    ranks = [r for r in trainers(lanes) if r.rank is not None]
    if len(ranks) < 2:
        return []
    findings = []
    counts = {r.rank: len(r.steps) for r in ranks}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"rank {k}: {v}" for k, v in counts.items())
        most, least = max(counts.values()), min(counts.values())
        finding = _finding(
            "unbalanced_data", (most - least) / most, f"the ranks ran different numbers of steps ({listing}): in a "
            f"synchronous job the ranks with more batches wait in a collective for ranks that have stopped (a hang "
            f"until the timeout)", None,
            fix="give every rank the same number of batches: DistributedSampler(drop_last=True), or the same "
                "global batches split per rank (gpulab train does this)")
        finding["share_of"] = "steps"  # the steps only some ranks ran, not a share of step time
        findings.append(finding)
        findings[-1]["support"] = f"the step counts of {len(ranks)} ranks"
    steps = {r.rank: _Step(select_steady(r.steps, warmup_steps)[0] or r.steps, r.facts.get("ddp")) for r in ranks}
    S = statistics.median(s.S for s in steps.values())
    per_category = {"data_wait": "D", "sync": "Y", "h2d": "H", "other": "O"}
    worst = None
    for category, attr in per_category.items():
        values = {k: getattr(s, attr) for k, s in steps.items()}
        rank = max(values, key=values.get)
        others = statistics.median(v for k, v in values.items() if k != rank)
        excess = values[rank] - others
        if worst is None or excess > worst[0]:
            worst = (excess, category, rank, others)
    excess, category, rank, others = worst
    if S <= 0:
        return findings
    if excess / S < MIN_SHARE:  # no rank is late: is every rank waiting on the network instead?
        comm = _communication_bound(ranks, steps, S)
        return findings + ([comm] if comm else [])
    lane = next(r for r in ranks if r.rank == rank)
    waiting = [k for k in steps if k != rank]
    extra_wait = statistics.median(steps[k].C + steps[k].K for k in waiting) - (steps[rank].C + steps[rank].K)
    evidence = (f"rank {rank} spends {excess * 1e3:.1f} ms more per step in {PHASE_NAMES[category]} than the other "
                f"ranks ({getattr(steps[rank], per_category[category]) * 1e3:.1f} ms vs a median of {others * 1e3:.1f} ms; "
                f"{excess / S:.0%} of the {S * 1e3:.1f} ms step)")
    if extra_wait > 0:
        evidence += (f"; rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} wait{'' if len(waiting) > 1 else 's'} "
                     f"for it: {extra_wait * 1e3:.1f} ms more per step in compute and collectives, where the gradient "
                     f"allreduce is waited for")
    where = _hottest(lane, category)
    finding = _finding("straggler", excess / S, evidence, where,
                       fix=f"rank {rank} holds every rank back: " + RANK_FIXES[category])
    finding["rank"] = rank
    _add_support(lane, steps[rank], finding)
    findings.append(finding)
    return findings


# Every rank spends at least this share of its step in collectives, and none is late: the job is
# bound by communication rather than by one rank (below it, communication is a cost, not the cause).
COMM_BOUND_SHARE = 0.25


def _communication_bound(ranks: list[Recording], steps: dict[int, "_Step"], S: float) -> dict | None:
    shares = {k: s.K / s.S for k, s in steps.items() if s.S > 0}
    if not shares or min(shares.values()) < COMM_BOUND_SHARE:
        return None
    share = statistics.median(shares.values())
    listing = ", ".join(f"rank {k} {v:.0%}" for k, v in sorted(shares.items()))
    evidence = (f"every rank spends a large part of its step in collectives ({listing} of a {S * 1e3:.1f} ms step) "
                f"and none is late (no rank spends {MIN_SHARE:.0%} of the step more than the others in any host-side "
                f"phase): the gradients' allreduce itself is the cost")
    busiest = max(ranks, key=lambda r: steps[r.rank].K)
    finding = _finding("communication_bound", share, evidence, _hottest(busiest, "collective"), fix=(
        "communicate less per sample: a larger per-rank batch, or several micro-batches per allreduce (gradient "
        "accumulation with DDP's no_sync(), gpulab train --accumulate N); larger buckets so fewer, bigger messages "
        "(DDP(bucket_cap_mb=...)); bf16/fp16 gradient compression (DDP comm hooks) - or fewer ranks, when one "
        "machine's link is the limit (measure it: gpulab bench allreduce)"))
    finding["support"] = f"the collective share of {len(shares)} ranks"
    return finding
