"""The device side of a recording: the sampled GPUs and process, and how long the device was busy
per step."""

from __future__ import annotations

from gpulab.monitor.analyze.step_costs import StepCosts
from gpulab.monitor.events import Recording


def used_gpu_indices(rec: Recording, gpus: list[dict]) -> list[int]:
    """NVML indices of the GPUs the script allocated memory on (matched by UUID). A process that
    died before saying which, but left records only a CUDA job leaves (the kernel window, host
    syncs or copies: cuda.py notes them on CUDA tensors only), used the first GPU."""
    used = (rec.cuda or {}).get("devices", [])
    torch_uuids = {d["uuid"].removeprefix("GPU-") for d in used if d.get("uuid")}
    indices = [g["index"] for g in gpus if g.get("uuid", "").removeprefix("GPU-") in torch_uuids]
    if used and not indices:  # UUIDs unavailable: assume torch's first GPUs are NVML's visible ones
        indices = [g["index"] for g in gpus[: len(used)]]
    if not indices and rec.cuda is None and (rec.kernels is not None or rec.sites):
        indices = [g["index"] for g in gpus[:1]]
    return indices


def not_measured(rec: Recording, gpus: list[dict], used: list[int]) -> list[str]:
    """What the report lacks, and why, in words: a finding never stands in for a number not measured."""
    missing = []
    if not used and gpus and rec.start.get("torch_cuda_build") and rec.cuda is None and rec.recorded:
        missing.append("whether the script used the GPU: the process ended before it said so, and left no "
                       "CUDA-only record")
    if used:
        if rec.kernels is None:
            why = "the process ended before its steps" if rec.end is None else "the run ended before its steps"
            missing.append(f"kernels per step and device busy from the kernel window: the window did not run ({why})")
        elif "error" in rec.kernels:
            missing.append(f"kernels per step and device busy from the kernel window: {rec.kernels['error']}")
    return missing


def _samples_in(samples: list[dict], window: tuple[float, float] | None) -> list[dict]:
    """The samples inside `window`; all of them without a window, or when none fall inside."""
    inside = [s for s in samples if window[0] <= s["t"] <= window[1]] if window else []
    return inside or samples


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def summarize_devices(samples: list[dict], gpus: list[dict], used: list[int], window, start: dict) -> list[dict]:
    """Per GPU: mean and max of every sampled metric over the steady window; then the process."""
    chosen = _samples_in(samples, window)
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


def kernel_window(rec: Recording) -> dict | None:
    return rec.kernels if rec.kernels and "error" not in rec.kernels else None


def device_busy(rec: Recording, step: StepCosts, samples, gpus, used, window) -> tuple[float, str]:
    """Seconds per step the device was busy, and how that was measured: on CUDA the kernel window,
    else NVML; on a CPU run the CPU is the device."""
    if not used:
        return step.compute, "cpu"
    k = kernel_window(rec)
    if k:
        return k["device_busy_s_per_step"], f"kernel window over {k['steps']} steps"
    chosen = _samples_in(samples, window)
    positions = [p for p, g in enumerate(gpus) if g["index"] in used]
    rows = [s["gpus"][p] for s in chosen for p in positions if p < len(s["gpus"])]
    # NVML's per-process SM share counts this job alone; the device-wide kernel-active share also
    # counts every other process on a shared GPU, so it is the fallback, and says so.
    util = _mean(r.get("process_sm_pct") for r in rows)
    if util is not None:
        return util / 100 * step.seconds, "NVML per-process SM share of this job's processes"
    util = _mean(r.get("kernel_active_pct") for r in rows)
    if util is not None:
        return util / 100 * step.seconds, "NVML kernel-active share, device-wide (other processes on the GPU count too)"
    return step.compute, "unknown (no kernel window, no NVML): host compute time used instead"
