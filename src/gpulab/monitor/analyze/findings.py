"""What a finding is - a cause, its share, the evidence, the user's line and the fix - and the
fixes in words, shared by the per-process and the cross-rank rules."""

from __future__ import annotations

from gpulab.monitor.analyze.step_costs import StepCosts
from gpulab.monitor.events import Recording

MIN_SHARE = 0.10  # a cause is named when a fix would save at least this share of the step

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
    "host_wait": (
        "the training thread waits at that line instead of working: take the wait out of the loop (a "
        "time.sleep, a blocking read, write or request, a lock another thread holds), or hand the work it "
        "waits for to a background thread (logging, checkpoints, sending results) so the next step starts at once"
    ),
    "evaluation": (
        "evaluate less often or on less: Lightning - val_check_interval / check_val_every_n_epoch and "
        "limit_val_batches; HF Trainer - a larger eval_steps or eval_strategy='epoch', a smaller eval set; a loop "
        "of your own - every N epochs, on a subset, under torch.inference_mode() with a larger batch"
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
    "too_few_steps": (
        "profile a longer run: after the warm-up gpulab spends a few steps on its kernel window (CUDA), "
        "two on its memory window and, for a model written with torch functions, three on its operators window; "
        "the steps after those are the ones it judges (10 or more steps give findings)"
    ),
    "no_steps": (
        "let the script reach its training loop: steps are found from optimizer.step(), else from "
        "backward() calls (with the Python API, mark them with p.step())"
    ),
    "cpu_contention": (
        "run fewer torch compute threads (torch.set_num_threads, OMP_NUM_THREADS) and DataLoader "
        "workers than the cores other processes leave free, or give the job cores no other process "
        "shares (a machine or node of its own, a cpuset)"
    ),
    "none": (
        "the loop keeps the device busy; to go faster make the math cheaper (mixed precision, "
        "channels_last, torch.compile) or use more devices (gpulab train --devices ...)"
    ),
}


def finding(cause: str, share: float, evidence: str, where: str | None, fix_key: str | None = None,
            fix: str | None = None, share_of: str | None = None) -> dict:
    """`fix`, else FIXES[fix_key]; `share_of`: what the share is of, when not the step time."""
    f = {"cause": cause, "share": round(min(max(share, 0.0), 1.0), 4), "evidence": evidence, "where": where,
         "fix": fix if fix is not None else FIXES[fix_key]}
    if share_of is not None:
        f["share_of"] = share_of
    return f


MIN_LINE_PERIODS = 5  # a line whose samples weigh less than 5 sampling periods is not named
MIN_LINE_STEPS = 3  # a cost of every step is placed only at a line sampled in this many steps


def hottest(rec: Recording, category: str) -> str | None:
    """The user's line where `category` spent the most sampled time, of the lines sampled in
    MIN_LINE_STEPS steps or more: a line run once (a set-up, a job between two steps) is no place
    for a cost paid every step, however long it ran. None: no such line."""
    lines = rec.hot.get(category) or {}
    steps = rec.hot_steps.get(category) or {}
    every_step = {where: s for where, s in lines.items() if steps.get(where, 0) >= _steps_needed(rec)}
    return max(every_step, key=every_step.get) if every_step else None


def blocked_share(rec: Recording, category: str, where: str | None) -> float:
    """The share of `where`'s sampled time in `category` that the thread was blocked (asleep, in
    I/O, on a lock) rather than on a core or waiting for one; 0: not known."""
    seconds = (rec.hot.get(category) or {}).get(where, 0.0)
    blocked = (rec.hot_blocked.get(category) or {}).get(where, 0.0)
    return blocked / seconds if seconds > 0 else 0.0


def _steps_needed(rec: Recording) -> int:
    return min(MIN_LINE_STEPS, max(1, rec.steps_done))


def add_support(rec: Recording, step: StepCosts, f: dict) -> None:
    """What the finding rests on: the steps, and how its line was found (calls or samples)."""
    parts = [f"{step.n} steady steps"]
    where = f["where"]
    site = next((s for s in rec.sites if s["where"] == where), None) if where else None
    if site:
        parts.append(f"{site['count']} calls seen at that line")
    elif f.get("share_of") and any(loader.get("where") == where for loader in rec.loaders):
        parts.append("the line that iterated that DataLoader")  # a whole-run finding, from the loader's record
    elif where:
        seen, total = max(((lines.get(where, 0), sum(lines.values())) for lines in rec.hot.values()), default=(0, 0))
        if seen:
            parts.append(f"the line from {seen:.2f} s of {total:.2f} s of stack samples")
            if seen < MIN_LINE_PERIODS * rec.hot_interval_s:
                parts[-1] += " - too few to name it"
                f["where"] = None
    elif any(rec.hot.values()):
        parts.append(f"not placed at a line: no line of the script was sampled in {_steps_needed(rec)} or more steps")
    f["support"] = "; ".join(parts)
