"""The per-process rules: which cause is eating one process's step, and how much a fix can save.

Per steady step, in seconds (StepCosts, step_costs.py), with syncs the time blocked in host syncs
(the kernel window's too, where it saw more than gpulab timed):

    busy          the device busy: on the CPU, compute; on CUDA the kernel window's busy time, else
                  NVML's per-process SM share (else its kernel-active share) x step, else compute
    idle          max(0, step - busy)
    exposed       host work the device cannot hide: on CUDA max(0, step - syncs - copies - busy);
                  on the CPU, where everything is serial, data_wait + other

On CUDA the host normally runs ahead of the device, so host-side costs are free while the device
has queued work. What a fix can save (its share, of the step) is therefore bounded:

    host_sync, h2d_copy     min(syncs or copies, idle)   removing the wait lets the host run ahead
    input_pipeline          min(data_wait, exposed)
    launch_overhead         min(compute, exposed)        when the kernel window shows many tiny kernels
    low_device_utilization  min(other, exposed)          Python between the training calls, or a wait
                                                         there (its line's thread blocked: asleep, I/O, a lock);
                            else idle - the shares named CUDA idle time no cause accounts for
    cpu_only_torch          compute                      a CPU run beside a GPU
    cpu_contention          the threads' wait for a core (on CUDA no more than idle)

Worker restarts and evaluation are shares of the training time instead. A finding is named at
MIN_SHARE or more (a fast input pipeline in a compute-bound loop gets none); findings are ranked
by share, and "none" stands alone when nothing stands out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulab.host import CORE_SLACK
from gpulab.monitor.analyze.contention import CoreUse, contention_finding
from gpulab.monitor.analyze.devices import kernel_window
from gpulab.monitor.analyze.findings import FIXES, MIN_SHARE, add_support, blocked_share, finding, hottest
from gpulab.monitor.analyze.step_costs import StepCosts, phases_text
from gpulab.monitor.config import WORKERS_PER_CORE
from gpulab.monitor.events import PASS_START_COUNT, PASSES_COUNT, TRANSFORM_PREFIX, Recording

WAITING = 0.5  # a line where the thread was blocked this share of its time waits rather than computes
TINY_KERNEL_US = 20.0  # kernels this short cost about as much to launch as to run
MANY_KERNELS_PER_STEP = 20


def costly_transforms(rec: Recording, step: StepCosts) -> list[dict]:
    """Per-sample transforms run inside the fetch, costliest first: share of a steady step, where
    built. Timed only in a window of steps left out of the steady ones (record/probes/transforms.py),
    or in a run too short for one, in the warm-up steps."""
    sites = rec.facts.get("transforms") or {}
    timed = [s for s in rec.steps if any(k.startswith(TRANSFORM_PREFIX) for k in s.get("counts", {}))]
    window = [s for s in timed if s.get("profiled")] or timed
    seconds: dict[str, float] = {}
    for s in window:
        for key, value in s["counts"].items():
            if key.startswith(TRANSFORM_PREFIX):
                name = key.removeprefix(TRANSFORM_PREFIX)
                seconds[name] = seconds.get(name, 0.0) + value / len(window)
    ranked = [{"name": name, "share": round(per_step / step.seconds, 4) if step.seconds else 0.0,
               "ms_per_step": round(per_step * 1e3, 3), "where": (sites.get(name) or {}).get("where")}
              for name, per_step in seconds.items()]
    return sorted(ranked, key=lambda t: t["share"], reverse=True)


@dataclass
class _Budget:
    """Per step: the device busy and idle, the host blocked in syncs, host work the device cannot hide."""

    busy: float
    source: str
    on_cuda: bool
    idle: float
    sync_blocked: float
    exposed: float

    def idle_text(self, seconds: float) -> str:
        return f"; the device was idle {self.idle / seconds:.0%} of the step ({self.source})" if self.on_cuda else ""


def _budget(rec: Recording, step: StepCosts, busy: float, source: str, on_cuda: bool) -> _Budget:
    sync_blocked = step.syncs
    k = kernel_window(rec)
    if k:  # the window also saw syncs inside calls gpulab does not time
        sync_blocked = max(sync_blocked, k["runtime_sync_s_per_step"] - step.copies)
    if on_cuda:  # the host's time not blocked on the device, beyond the device's
        exposed = max(0.0, step.seconds - sync_blocked - step.copies - busy)
    else:  # the CPU is the device: everything that is not compute is in its way
        exposed = step.data_wait + step.other
    return _Budget(busy, source, on_cuda, max(0.0, step.seconds - busy), sync_blocked, exposed)


def process_findings(rec: Recording, step: StepCosts, busy: float, busy_source: str, gpus: list[dict],
                     used: list[int], cores: CoreUse | None) -> list[dict]:
    """`cores`: how the job used its cores over the steady steps, None where not measured."""
    b = _budget(rec, step, busy, busy_source, on_cuda=bool(used))
    idle_share = b.idle / step.seconds if b.on_cuda else None
    contention = contention_finding(cores, _torch_threads(rec), _workers(rec), idle_share)
    candidates = [_input_finding(rec, step, b, cores), _restart_finding(rec, step), _evaluation_finding(rec),
                  _other_finding(rec, step, b), contention]
    if b.on_cuda:
        candidates += [_sync_finding(rec, step, b), _h2d_finding(rec, step, b), _launch_finding(rec, step, b)]
    elif gpus and _known_not_to_use_cuda(rec):
        candidates.append(_cpu_only_finding(rec, step, gpus))
    findings = [f for f in candidates if f is not None and f["share"] >= MIN_SHARE]
    if b.on_cuda:
        findings += _unexplained_idle(rec, step, b, findings)
    findings.sort(key=lambda f: f["share"], reverse=True)
    findings = findings or [_nothing_stands_out(rec, step, b)]
    for f in findings:
        add_support(rec, step, f)
    return findings


def _input_finding(rec: Recording, step: StepCosts, b: _Budget, cores: CoreUse | None) -> dict:
    seconds, loader = step.seconds, rec.fed_loader
    evidence = (f"waited {step.data_wait * 1e3:.1f} ms per step for the next batch "
                f"({step.data_wait / seconds:.0%} of the step, {step.n} steps)")
    if loader:
        evidence += "; " + _loader_text(loader, pin_memory=True)
    transforms = [t for t in costly_transforms(rec, step) if t["share"] >= 0.02][:3]
    if transforms:
        evidence += "; per-sample transforms: " + ", ".join(
            f"{t['name']} {t['share']:.0%} of the step" + (f" at {t['where']}" if t["where"] else "")
            for t in transforms)
    workers = loader["num_workers"] if loader else 0
    needed = _workers_to_keep_up(step.data_wait, seconds, workers)
    spare = _spare_cores(rec, b.on_cuda, workers, cores)
    waits = _fetching_waits(rec) if workers == 0 else _workers_wait(rec, workers, cores)
    rest = f"{(seconds - step.data_wait) * 1e3:.1f} ms"
    if waits:
        n = min(needed, _most_workers(rec, cores))
        enough = (f"{n} keep up with the rest of the step ({rest})" if n == needed else
                  f"{n}, {WORKERS_PER_CORE} a core, come closest ({needed} would keep up with the rest of the step, "
                  f"{rest})")
        fix = _in_parallel(n, f"{waits}, so workers need little CPU and {enough}; torch may warn of more workers than "
                              f"cores: these wait, they do not compute")
    elif spare >= 1 and not (cores and cores.wait.contended):
        measured = f" (the job kept {cores.job_cores:.1f} of its {cores.wait.cores} cores busy)" if cores else ""
        fix = _in_parallel(min(workers + spare, needed), f"{spare} core(s) are spare{measured}")
    else:
        # Measured on this project's 2-core VM: with torch's threads busy on every core one worker
        # made one data-bound script 1.96x faster and another 0.86x: no rule from the recording
        # tells which, so say what is known and how to measure it.
        fix = (f"more DataLoader workers are no sure win here: {_taken_cores(rec, b.on_cuda, workers, cores)}, so "
               f"workers would compete with the training for them - measure before changing it: gpulab profile "
               f"--try num_workers={workers + 1} --steps 30 -- ...; ")
    fix += FIXES["input_pipeline_cheaper"]
    if transforms:
        fix = f"apply {transforms[0]['name']} once per batch (on the device), not per sample in __getitem__; " + fix
    where = hottest(rec, "data_wait") or (loader or {}).get("where")
    return finding("input_pipeline", min(step.data_wait, b.exposed) / seconds, evidence + b.idle_text(seconds), where,
                   fix=fix)


def _in_parallel(n: int, why: str) -> str:
    return (f"load batches in parallel: DataLoader(num_workers={n}, persistent_workers=True) - {why}; check it: "
            f"gpulab profile --try num_workers={n} --steps 30 -- ...; ")


def _loader_text(loader: dict, pin_memory: bool = False) -> str:
    """"DataLoader(batch_size=64, num_workers=2) built at train.py:12"."""
    pinned = f", pin_memory={loader['pin_memory']}" if pin_memory else ""
    built = f" built at {loader['built']}" if loader.get("built") else ""
    return f"DataLoader(batch_size={loader['batch_size']}, num_workers={loader['num_workers']}{pinned}){built}"


def _fetching_waits(rec: Recording) -> str | None:
    """Why the training thread's own fetches (no workers) wait rather than compute, in words: its
    hottest line in the data wait was mostly blocked (sleeps, reads, a request); None when it
    computes or nothing says (workers' fetches are not sampled)."""
    where = hottest(rec, "data_wait")
    blocked = blocked_share(rec, "data_wait", where)
    if blocked < WAITING:
        return None
    return f"the fetch was blocked (asleep, in I/O) {blocked:.0%} of its time at {where}"


def _workers_wait(rec: Recording, workers: int, cores: CoreUse | None) -> str | None:
    """Why the workers' fetches wait rather than compute, in words: the loop's thread waited for
    their batches blocked (at least WAITING of its data wait's samples) while they kept less than
    WAITING of a core each busy. None when they compute; or when the loop's wait is its own work
    (receiving and unpickling batches the workers had ready: idle workers that keep up); or when
    nothing says."""
    if cores is None or cores.children_cores is None or cores.children_cores >= WAITING * workers:
        return None
    if blocked_share(rec, "data_wait", hottest(rec, "data_wait")) < WAITING:
        return None
    return (f"the loop waited on its {workers} worker(s), yet they kept {cores.children_cores:.2f} core(s) busy: "
            f"their fetches wait (asleep, in I/O) more than they compute")


def _workers_to_keep_up(wait_s: float, step_s: float, workers: int) -> int:
    """Workers that make a batch as fast as the rest of the step uses one (more than `workers`): a
    worker takes as long for a batch as the loop waits now without workers (`wait_s` of a `step_s`
    step), or `workers` steps with them."""
    rest = step_s - wait_s
    per_batch = wait_s if workers == 0 else workers * step_s
    needed = math.ceil(round(per_batch / max(rest, 1e-9), 6))  # 4.0000001 is 4
    return max(needed, workers + 1)


def _most_workers(rec: Recording, cores: CoreUse | None) -> int:
    """The most workers gpulab advises: WORKERS_PER_CORE a usable core."""
    return WORKERS_PER_CORE * (cores.wait.cores if cores else rec.start.get("cpu_count") or 1)


def _training_seconds(rec: Recording, tail: bool = False) -> float:
    """The seconds of every step recorded (blocks too), and of the run's tail after them with `tail`."""
    seconds = sum(sum(r["excl"].values()) for r in rec.steps + rec.blocks)
    return seconds + (sum((rec.tail or {}).get("excl", {}).values()) if tail else 0.0)


def _restart_finding(rec: Recording, step: StepCosts) -> dict | None:
    """Worker processes started again at every pass over a DataLoader (no persistent_workers): what
    the passes took to start beyond a batch's usual wait, as a share of the training time (the
    steady steps leave these long steps out). A loader's first pass starts them whatever its
    settings: it does not count."""
    restarting = [loader for loader in rec.loaders if loader["num_workers"] and not loader["persistent_workers"]]
    if not restarting:
        return None
    unavoidable = sum(1 for loader in rec.loaders if loader["num_workers"])
    start_s = passes = 0.0
    for r in rec.steps + rec.blocks:
        n = r["counts"].get(PASSES_COUNT, 0)
        if n and unavoidable > 0:  # a first pass of a loader
            unavoidable -= n
            continue
        start_s, passes = start_s + r["counts"].get(PASS_START_COUNT, 0.0), passes + n
    excess = start_s - passes * step.data_wait
    training = _training_seconds(rec)
    if passes < 1 or excess <= 0 or training <= 0:
        return None
    loader = max(restarting, key=lambda x: x.get("steps_fed", 0))
    evidence = (f"{passes:.0f} passes over the DataLoader after the first each took {excess / passes:.2f} s to start "
                f"beyond a batch's usual wait ({excess:.1f} s, {excess / training:.0%} of the training time): its "
                f"{loader['num_workers']} worker processes start again at every pass (persistent_workers=False)")
    return finding("input_pipeline", excess / training, evidence, loader.get("where"), "input_pipeline_restart",
                   share_of="the training time")


def _evaluation_finding(rec: Recording) -> dict | None:
    """Passes over DataLoaders that fed no training step - evaluations - as a share of the training
    time, tail included: the steady steps leave the long ones out and count the short ones' forward
    as compute, so neither says what they cost."""
    evaluated = [loader for loader in rec.loaders if not loader.get("steps_fed") and loader.get("pass_seconds")]
    if not evaluated or not any(loader.get("steps_fed") for loader in rec.loaders):
        return None
    seconds = sum(loader["pass_seconds"] for loader in evaluated)
    passes = sum(loader.get("passes", 0) for loader in evaluated)
    training = _training_seconds(rec, tail=True)
    if training <= 0 or passes < 1:
        return None
    loader = max(evaluated, key=lambda x: x["pass_seconds"])
    evidence = (f"{passes} passes over DataLoaders that fed no training step took {seconds:.2f} s "
                f"({seconds / passes * 1e3:.0f} ms each, {min(seconds / training, 1.0):.0%} of the training time): "
                f"evaluation; the most over {_loader_text(loader)}")
    return finding("evaluation", seconds / training, evidence, loader.get("where"), "evaluation",
                   share_of="the training time")


def _spare_cores(rec: Recording, on_cuda: bool, workers: int, cores: CoreUse | None) -> int:
    """Cores that DataLoader workers could use without taking them from the training itself.

    Measured: the cores the job left idle over the steady steps, less one per rank for its
    training thread (a data wait that sleeps or reads leaves cores idle whatever torch's thread
    count). Else from the counts: the CPU's compute uses torch's intra-op threads, a GPU trainer's
    Python about one core. Running workers use one each. Every rank on this machine
    (local_world_size) takes as much as this one and would add as many workers: each gets its share."""
    ranks_here = rec.local_world_size or 1
    if cores is not None:
        idle = min(int(cores.idle_cores + CORE_SLACK), cores.wait.cores - ranks_here * (1 + workers))
        return max(0, idle) // ranks_here
    count = rec.start.get("cpu_count") or 1
    trainer = 1 if on_cuda else _torch_threads(rec)
    return max(0, count - ranks_here * (trainer + workers)) // ranks_here


def _taken_cores(rec: Recording, on_cuda: bool, workers: int, cores: CoreUse | None) -> str:
    """Why no core is spare, in words: measured contention, the measured use, or the counts."""
    users = "the trainer's own Python" if on_cuda else f"torch's {_torch_threads(rec)} compute thread(s)"
    users += f", {workers} worker(s)" if workers else ""
    if cores is not None and cores.wait.contended:
        return (f"the job's threads already waited for a core {cores.wait.share:.0%} of the step (cpu_contention; "
                f"other processes used {cores.wait.others_cores:.1f} of its {cores.wait.cores} cores)")
    if cores is not None:
        return f"the job kept {cores.job_cores:.1f} of its {cores.wait.cores} cores busy ({users})"
    return f"the {rec.start.get('cpu_count')} cores are taken ({users})"


def _workers(rec: Recording) -> int:
    return max((loader["num_workers"] for loader in rec.loaders), default=0)


def _torch_threads(rec: Recording) -> int:
    """The training's intra-op threads, as last seen (scripts often set them after importing torch)."""
    return rec.facts.get("torch_threads") or rec.start.get("torch_threads") or 1


def _other_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
    """Held back (None) unless the Python between the calls takes MIN_SHARE of the step in every
    quarter of the run: a share that dips below it within one run is as likely to be under it in
    the next (a DDP tutorial's loop Python moved between 4% and 11% from quarter to quarter)."""
    seconds = step.seconds
    quarters = step.share_by_quarter("other")
    if min(quarters) < MIN_SHARE:
        return None
    where = hottest(rec, "other")
    blocked = blocked_share(rec, "other", where)
    what = (f"waiting between the training calls: at that line the thread was blocked (asleep, in I/O or on a "
            f"lock) {blocked:.0%} of its sampled time" if blocked >= WAITING else "Python between the training calls")
    evidence = (f"{step.other * 1e3:.1f} ms per step ({step.other / seconds:.0%}; "
                f"{min(quarters):.0%}-{max(quarters):.0%} across the run's quarters) is {what} (outside data loading, forward, backward and the optimizer)")
    share = min(step.other, b.exposed) / seconds
    prefetcher = next((loader for loader in rec.loaders if loader.get("elsewhere")), None)
    if blocked >= WAITING and prefetcher is not None:
        return _prefetched_finding(rec, step, prefetcher, share, evidence + b.idle_text(seconds), where)
    return finding("low_device_utilization", share, evidence + b.idle_text(seconds), where,
                   "host_wait" if blocked >= WAITING else "low_device_utilization")


def _prefetched_finding(rec: Recording, step: StepCosts, loader: dict, share: float, evidence: str,
                        where: str | None) -> dict:
    """The loop waits at a line of its own while a DataLoader is iterated in another thread (a
    prefetching thread that fills a queue): the batches are what it waits for."""
    evidence += (f"; meanwhile {_loader_text(loader)} was iterated in another thread (at {loader['where']}): the "
                 f"loop waits for its batches")
    n = min(_workers_to_keep_up(step.other, step.seconds, loader["num_workers"]), _most_workers(rec, None))
    fix = (f"feed that DataLoader faster: give it workers (DataLoader(num_workers={n}, persistent_workers=True); check "
           f"it: gpulab profile --try num_workers={n} --steps 30 -- ...); " + FIXES["input_pipeline_cheaper"])
    return finding("input_pipeline", share, evidence, where, fix=fix)


def _unexplained_idle(rec: Recording, step: StepCosts, b: _Budget, findings: list[dict]) -> list[dict]:
    """CUDA idle time that no cause named accounts for."""
    seconds = step.seconds
    unexplained = b.idle / seconds - sum(f["share"] for f in findings)
    if unexplained < MIN_SHARE or any(f["cause"] == "low_device_utilization" for f in findings):
        return []
    evidence = (f"the device was busy only {b.busy / seconds:.0%} of each step ({b.source}); the host spent "
                f"{step.compute * 1e3:.1f} ms per step issuing forward/backward/optimizer work and "
                f"{step.other * 1e3:.1f} ms elsewhere")
    where = hottest(rec, "compute") or hottest(rec, "other")
    return [finding("low_device_utilization", unexplained, evidence, where, "low_device_utilization")]


def _nothing_stands_out(rec: Recording, step: StepCosts, b: _Budget) -> dict:
    seconds = step.seconds
    parts = phases_text({k: v for k, v in step.shares().items() if k != "compute"}, ", ")
    if b.on_cuda:
        head = f"the device was busy {min(b.busy / seconds, 1):.0%} of the step ({b.source})"
    else:
        head = f"compute takes {step.compute / seconds:.0%} of the step"
    if b.on_cuda and b.busy / seconds >= 1 - MIN_SHARE:
        # A device busy back to back hides the host's time whatever it does: once the launch
        # queue is full, whichever call comes next blocks (a loader's gather shows as data wait).
        return finding("none", min(b.busy / seconds, 1.0), f"{head}; the host's {parts} cost nothing then: they are "
                       f"where it waited for the device", None, "none")
    return finding("none", min(b.busy / seconds, 1.0), f"{head}; {parts}: nothing else stands out", None,
                   fix=_cheaper_math(rec))


def _cheaper_math(rec: Recording) -> str:
    """The advice for a busy loop: the ways to cheaper math it does not use yet (the recorder's
    "math" facts; without them, all of them)."""
    math = rec.facts.get("math")
    if not math:
        return FIXES["none"]
    tries, used, notes = [], [], []
    if math["autocast"]:
        used.append(f"{math['autocast']} autocast")
    elif math["bf16_native"]:
        tries.append("mixed precision: bf16 autocast")
    else:
        device = "CPU" if math["device"] == "cpu" else "device"
        notes.append(f"not bf16: this {device} has no native bf16, and torch would emulate it (~3x slower)")
    if math["channels_last"]:
        used.append("channels_last")
    elif math["channels_last"] is False:
        tries.append("channels_last")
    (used if rec.compiles else tries).append("torch.compile")
    fix = "the loop keeps the device busy; to go faster "
    if tries:
        fix += f"make the math cheaper ({', '.join(tries)}) or "
    fix += "use more devices (gpulab train --devices ...)"
    if used:
        fix += f"; it uses {', '.join(used)} already"
    return fix + "".join(f"; {note}" for note in notes)


def _sync_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
    top = _top_site(rec, ("sync",))
    if not top and b.sync_blocked <= 0:
        return None
    per_step = step.counts.get("sync", 0) + step.counts.get("sync_untimed", 0)
    evidence = (f"{per_step:.1f} host syncs per step kept the host blocked {b.sync_blocked * 1e3:.1f} ms per step, "
                f"so the device could not run ahead while Python prepared the next step")
    if top:
        evidence += f"; top: {'/'.join(top['ops'])} at {top['where']} ({top['count']} calls, {top['seconds']:.2f} s)"
    return finding("host_sync", min(b.sync_blocked, b.idle) / step.seconds, evidence + b.idle_text(step.seconds),
                   top["where"] if top else None, "host_sync")


def _h2d_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
    """Copies the host waited for: from pageable memory, or from pinned memory without
    non_blocking=True (pinning alone does not make a copy asynchronous)."""
    pageable = step.counts.get("h2d_pageable", 0)
    pinned_blocking = step.counts.get("h2d_pinned_blocking", 0)
    if not pageable and not pinned_blocking:
        return None
    kinds = [kind for kind, n in (("h2d_pageable", pageable), ("h2d_pinned_blocking", pinned_blocking)) if n]
    top = _top_site(rec, kinds)
    parts = []
    if pageable:
        mb = step.counts.get("h2d_pageable_bytes", 0) / 1e6
        parts.append(f"{pageable:.1f} host-to-device copies per step from pageable memory ({mb:.1f} MB)")
    if pinned_blocking:
        mb = step.counts.get("h2d_pinned_blocking_bytes", 0) / 1e6
        parts.append(f"{pinned_blocking:.1f} per step from pinned memory without non_blocking=True, so the "
                     f"host waited anyway ({mb:.1f} MB)")
    evidence = "; ".join(parts) + f", {step.copies * 1e3:.1f} ms per step in the copy calls"
    return finding("h2d_copy", min(step.copies, b.idle) / step.seconds, evidence + b.idle_text(step.seconds),
                   top["where"] if top else None, "h2d_copy" if pageable else "h2d_copy_pinned")


def _top_site(rec: Recording, kinds) -> dict | None:
    """The sync or copy line of one of `kinds` that weighs most on the steps."""
    return max((s for s in rec.sites if s["kind"] in kinds), key=weight_in_the_steps, default=None)


def weight_in_the_steps(site: dict) -> tuple:
    """How much a sync or copy line weighs on the steps: its calls after the warm-up first (a
    set-up copy that also paid for CUDA's start-up is not the line the steps wait at), then the
    whole run (recordings without the steady counts)."""
    return site.get("steady_seconds", 0.0), site.get("steady_count", 0), site["seconds"], site["count"]


def _launch_finding(rec: Recording, step: StepCosts, b: _Budget) -> dict | None:
    k = kernel_window(rec)
    if not k or k["kernel_median_us"] is None:
        return None
    if k["kernel_median_us"] > TINY_KERNEL_US or k["kernels_per_step"] < MANY_KERNELS_PER_STEP:
        return None
    evidence = (f"{k['kernels_per_step']:.0f} kernels per step, median {k['kernel_median_us']:.1f} us each; the "
                f"device was busy {b.busy * 1e3:.2f} ms of each {step.seconds * 1e3:.2f} ms step while the host spent "
                f"{step.compute * 1e3:.2f} ms issuing forward/backward/optimizer work")
    share = min(step.compute, b.exposed) / step.seconds
    return finding("launch_overhead", share, evidence, hottest(rec, "compute"), "launch_overhead")


def _known_not_to_use_cuda(rec: Recording) -> bool:
    """Only what the process said of itself: a CPU-only torch, or its account of CUDA naming no
    device. A process that died before saying is not known not to have used the GPU."""
    if rec.start.get("torch_cuda_build") is None:
        return True
    return rec.cuda is not None and not rec.cuda.get("devices")


def _cpu_only_finding(rec: Recording, step: StepCosts, gpus: list[dict]) -> dict:
    names = ", ".join(sorted({g["name"] for g in gpus}))
    if rec.start.get("torch_cuda_build") is None:
        evidence = f"torch {rec.start.get('torch')} is a CPU-only build while {len(gpus)} GPU(s) are present ({names})"
        fix = "cpu_only_build"
    else:
        evidence = f"torch can use the GPU ({names}) but the script never put work on it"
        fix = "cpu_only_placement"
    evidence += f"; the CPU computed for {step.compute * 1e3:.1f} ms of each {step.seconds * 1e3:.1f} ms step"
    return finding("cpu_only_torch", step.compute / step.seconds, evidence, hottest(rec, "compute"), fix)
