"""The per-process rules: which cause is eating one process's step, and how much a fix can save.

The model (per steady-state step, all times in seconds):

    S  step time                     D  waiting for data         H  host->device copies
    C  host time in forward/backward/optimizer                   Y  blocked in host syncs
    O  other: the user's Python between those calls              (phases.py: S = D + H + C + K + Y + O)
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

from dataclasses import dataclass

from gpulab.monitor.analyze.devices import kernel_window
from gpulab.monitor.analyze.findings import FIXES, MIN_SHARE, add_support, finding, hottest
from gpulab.monitor.analyze.phases import PHASE_NAMES, StepCosts, shown_phases
from gpulab.monitor.events import TRANSFORM_PREFIX, Recording

TINY_KERNEL_US = 20.0  # kernels this short cost about as much to launch as to run
MANY_KERNELS_PER_STEP = 20


def costly_transforms(rec: Recording, step: "StepCosts") -> list[dict]:
    """Per-sample transforms run inside the fetch, costliest first: share of the step, where built."""
    sites = rec.facts.get("transforms") or {}
    ranked = []
    for key, seconds in step.counts.items():
        if key.startswith(TRANSFORM_PREFIX):
            name = key.removeprefix(TRANSFORM_PREFIX)
            ranked.append({"name": name, "share": round(seconds / step.S, 4) if step.S else 0.0,
                           "ms_per_step": round(seconds * 1e3, 3), "where": (sites.get(name) or {}).get("where")})
    return sorted(ranked, key=lambda t: t["share"], reverse=True)


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


def _budget(rec: Recording, step: StepCosts, busy: float, source: str, on_cuda: bool) -> _Budget:
    sync_blocked = step.Y
    k = kernel_window(rec)
    if k:  # the window also saw syncs inside calls gpulab does not time
        sync_blocked = max(sync_blocked, k["runtime_sync_s_per_step"] - step.H)
    if on_cuda:
        host_active = step.S - sync_blocked - step.H
        exposed = max(0.0, host_active - busy)
    else:  # the CPU is the device: everything that is not compute is in its way
        exposed = step.D + step.O
    return _Budget(busy, source, on_cuda, max(0.0, step.S - busy), sync_blocked, exposed)


def process_findings(rec: Recording, step: StepCosts, busy: float, busy_source: str, gpus: list[dict],
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
        add_support(rec, step, f)
    return findings


def _input_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict:
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
    where = hottest(rec, "data_wait") or (loader or {}).get("where")
    return finding("input_pipeline", min(step.D, b.exposed) / S, evidence + b.idle_text(S), where, fix=fix)


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


def _other_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict:
    S = step.S
    evidence = (f"{step.O * 1e3:.1f} ms per step ({step.O / S:.0%}) is Python between the training calls "
                f"(outside data loading, forward, backward and the optimizer)")
    return finding("low_device_utilization", min(step.O, b.exposed) / S, evidence + b.idle_text(S),
                    hottest(rec, "other"), "low_device_utilization")


def _unexplained_idle(rec: Recording, step: StepCosts, b: _Budget, findings: list[dict]) -> list[dict]:
    """Device idle time that no specific cause accounts for."""
    S = step.S
    unexplained = b.idle / S - sum(f["share"] for f in findings)
    if unexplained < MIN_SHARE or any(f["cause"] == "low_device_utilization" for f in findings):
        return []
    evidence = (f"the device was busy only {b.busy / S:.0%} of each step ({b.source}); the host spent "
                f"{step.C * 1e3:.1f} ms per step issuing forward/backward/optimizer work and "
                f"{step.O * 1e3:.1f} ms elsewhere")
    where = hottest(rec, "compute") or hottest(rec, "other")
    return [finding("low_device_utilization", unexplained, evidence, where, "low_device_utilization")]


def _nothing_stands_out(step: StepCosts, b: _Budget) -> dict:
    S = step.S
    parts = ", ".join(f"{PHASE_NAMES[name]} {value:.0%}" for name, value in shown_phases(step.shares()) if name != "compute")
    if b.on_cuda:
        head = f"the device was busy {min(b.busy / S, 1):.0%} of the step ({b.source})"
    else:
        head = f"compute takes {step.C / S:.0%} of the step"
    return finding("none", min(b.busy / S, 1.0), f"{head}; {parts}: nothing else stands out", None, "none")


def _sync_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
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
    return finding("host_sync", min(b.sync_blocked, b.idle) / step.S, evidence + b.idle_text(step.S), where, "host_sync")


def _h2d_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
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
    return finding("h2d_copy", min(step.H, b.idle) / step.S, evidence + b.idle_text(step.S), where, fix)


def _launch_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
    k = kernel_window(rec)
    if not k or k["kernel_median_us"] is None:
        return None
    if k["kernel_median_us"] > TINY_KERNEL_US or k["kernels_per_step"] < MANY_KERNELS_PER_STEP:
        return None
    evidence = (f"{k['kernels_per_step']:.0f} kernels per step, median {k['kernel_median_us']:.1f} us each; the "
                f"device was busy {b.busy * 1e3:.2f} ms of each {step.S * 1e3:.2f} ms step while the host spent "
                f"{step.C * 1e3:.2f} ms issuing forward/backward/optimizer work")
    share = min(step.C, b.exposed) / step.S
    return finding("launch_overhead", share, evidence, hottest(rec, "compute"), "launch_overhead")


def _cpu_only_finding(rec: Recording, step: StepCosts, gpus: list[dict]) -> dict:
    names = ", ".join(sorted({g["name"] for g in gpus}))
    if rec.start.get("torch_cuda_build") is None:
        evidence = f"torch {rec.start.get('torch')} is a CPU-only build while {len(gpus)} GPU(s) are present ({names})"
        fix = "cpu_only_build"
    else:
        evidence = f"torch can use the GPU ({names}) but the script never put work on it"
        fix = "cpu_only_placement"
    evidence += f"; the CPU computed for {step.C * 1e3:.1f} ms of each {step.S * 1e3:.1f} ms step"
    return finding("cpu_only_torch", step.C / step.S, evidence, hottest(rec, "compute"), fix)
