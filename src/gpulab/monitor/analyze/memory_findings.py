"""Memory in the report: the measured step's peak and what it is made of (by the categories of
gpulab.memory.categories), and - when the script ran out of memory - the finding that says where,
what was in use, and which fix frees how much."""

from __future__ import annotations

from gpulab.memory.categories import CATEGORY_NAMES, size
from gpulab.monitor.analyze.findings import finding
from gpulab.monitor.events import Recording

TOP_MODULES = 3
SHARD_DEVICES = 2  # the sharded-optimizer fix is priced for this many devices


def memory_summary(rec: Recording) -> dict | None:
    """report.json's `memory`: the measured step (None: the run had too few steps for the window)."""
    m = rec.memory
    if m is None:
        return None
    if "error" in m:
        return {"error": m["error"]}
    summary = {k: m[k] for k in ("device", "how", "step", "peak", "live_start", "live_end", "at_peak", "sizes",
                                 "activations_by_module", "batch", "reserved")}
    summary["peak_phase"] = phase_at(rec, m["step"], m.get("peak_t"))
    if m.get("batch"):
        summary["per_sample"] = {k: round(m["sizes"][k] / m["batch"]) for k in ("activations", "inputs")}
    return summary


def phase_at(rec: Recording, step_index: int, t: float | None) -> str:
    """What the training thread was doing at time t of a step: the innermost span around t."""
    step = next((s for s in rec.steps if s.get("i") == step_index and "spans" in s), None)
    if step is None or t is None:
        return "unknown"
    around = [s for s in step["spans"] if s[2] <= t <= s[3]]
    if not around:
        return "between the training calls"
    name, category, _, _ = min(around, key=lambda s: s[3] - s[2])
    if name in ("backward", "autograd.grad"):
        return "backward"
    if name.endswith(".step"):
        return f"optimizer step ({name.removesuffix('.step')})"
    if category == "data_wait":
        return "loading data"
    if category == "compute" and not name.endswith(".zero_grad") and "_" not in name:
        return f"forward ({name})"
    return name


def memory_line(summary: dict) -> str:
    """The terminal's one line: the peak, where it happened, its largest parts."""
    if "error" in summary:
        return f"memory: not measured ({summary['error']})"
    parts = sorted(summary["at_peak"].items(), key=lambda kv: kv[1], reverse=True)
    shown = ", ".join(f"{CATEGORY_NAMES[k]} {size(v)}" for k, v in parts if v > 0.01 * summary["peak"])
    line = f"memory: peak {size(summary['peak'])} on {summary['device']} in {summary['peak_phase']} - {shown}"
    top = summary["activations_by_module"][:TOP_MODULES]
    if top and summary["sizes"]["activations"]:
        line += (f"; forward saves {size(summary['sizes']['activations'])} of activations"
                 + (f" ({size(summary['per_sample']['activations'])} per sample)" if summary.get("per_sample") else "")
                 + ", most in " + ", ".join(f"{name}{f' ({cls})' if cls else ''} {size(n)}" for name, cls, n in top))
    return line


def oom_finding(rec: Recording, who: str | None = None) -> dict | None:
    """The script ran out of memory: where, how much was asked, what was in use, and the fixes
    ranked by the bytes each would free. `who`: the process, when it is not the diagnosed one."""
    oom = rec.oom
    if oom is None:
        return None
    in_use = oom.get("in_use") or {}
    where = oom.get("where")
    evidence = (f"{who + ' ' if who else ''}ran out of memory on {oom.get('device', '?')} in {oom['phase']}"
                f"{f' at {where}' if where else ''}: asked for {size(oom.get('requested'))} with "
                f"{size(oom.get('total_in_use'))} in use")
    if in_use:
        parts = sorted(in_use.items(), key=lambda kv: kv[1], reverse=True)
        evidence += " - " + ", ".join(f"{CATEGORY_NAMES[k]} {size(v)}" for k, v in parts if v)
        evidence += f"; the largest is {CATEGORY_NAMES[parts[0][0]]}"
        if in_use.get("other"):
            evidence += f"; other is {_what_other_is(oom['phase'])}"
    evidence += _beside_the_tensors(oom) + _the_limit(oom)
    evidence += f" [{oom['message']}]"
    fixes = oom_fixes(oom, rec.memory)
    f = finding("out_of_memory", 1.0, evidence, where, share_of="the run (it ended it)",
                fix="; ".join(f"{i}. {x['fix']} (frees ~{size(x['frees'])})" for i, x in enumerate(fixes, 1))
                or "make the step smaller: a smaller batch, or fewer or smaller layers")
    f["fixes"] = fixes
    return f


def _what_other_is(phase: str) -> str:
    """What the allocator counts that no category explains (tensors the failing frames and the
    autograd graph do not reach), by what the step was doing."""
    if phase == "backward":
        return ("what only autograd's engine holds: the gradients flowing between layers, and the failing op's "
                "temporaries (and cuBLAS's workspace)")
    if phase.startswith("optimizer"):
        return "the optimizer's temporaries (a foreach step's scratch copies) and tensors outside the step's frames"
    return ("the failing op's temporaries, tensors outside the step's frames (a dataset, kept outputs) and cuBLAS's "
            "workspace")


def _beside_the_tensors(oom: dict) -> str:
    """On CUDA, what the process held beside its tensors: the allocator's cache, the CUDA context."""
    reserved, total = oom.get("reserved"), oom.get("total_in_use") or 0
    if reserved is None:
        return ""
    parts = [f"the allocator kept {size(max(0, reserved - total))} cached (reserved, unused)"]
    if oom.get("process_total"):
        parts.append(f"{size(max(0, oom['process_total'] - reserved))} went to the CUDA context and libraries "
                     f"(outside PyTorch's allocator)")
    return "; besides, " + " and ".join(parts)


def _the_limit(oom: dict) -> str:
    """The limit hit: the allocator's cap (set_per_process_memory_fraction) when below the device's."""
    if oom.get("limit") and oom.get("device_total") and oom["limit"] < oom["device_total"]:
        return (f"; the limit hit is the allocator's {size(oom['limit'])} (set_per_process_memory_fraction), "
                f"not the device's {size(oom['device_total'])}")
    if oom.get("device_total"):
        return f"; the limit hit is the device's {size(oom['device_total'])}"
    return ""


def oom_fixes(oom: dict, window: dict | None) -> list[dict]:
    """Each fix with the bytes it would free at the moment memory ran out, largest first."""
    use = oom.get("in_use") or {}
    activations, inputs = use.get("activations", 0), use.get("inputs", 0)
    fixes = []
    if activations + inputs:
        fixes.append({"fix": "halve the batch per step and accumulate two micro-batches per optimizer step (the same "
                             "global batch: gpulab train --accumulate 2; in your loop, (loss / 2).backward() per half)",
                      "frees": (activations + inputs) // 2})
    if activations:
        modules = _largest_modules(window)
        target = (f"the modules that save the most ({', '.join(modules)})" if modules
                  else "the largest blocks of the model")
        fixes.append({"fix": f"activation checkpointing (torch.utils.checkpoint) on {target}: their activations are "
                             "recomputed in backward instead of kept, at the cost of a second forward",
                      "frees": activations // 2})
        if oom.get("dtype") == "float32":
            fixes.append({"fix": "bf16 autocast (torch.autocast(device_type, dtype=torch.bfloat16); gpulab train "
                                 "--precision bf16): activations stored in 2 bytes instead of 4",
                          "frees": activations // 2})
    state = use.get("parameters", 0) + use.get("gradients", 0) + use.get("optimizer_state", 0)
    if state:
        fixes.append({"fix": f"shard parameters, gradients and optimizer state over {SHARD_DEVICES} devices "
                             "(FSDP / ZeRO-3: torch.distributed.fsdp.fully_shard)",
                      "frees": state * (SHARD_DEVICES - 1) // SHARD_DEVICES})
    spare = (oom.get("reserved") or 0) - (oom.get("total_in_use") or 0)
    if spare > 0.25 * max(oom.get("total_in_use") or 0, 1):
        fixes.append({"fix": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: the allocator holds memory it cannot "
                             "reuse for this request (fragmentation)", "frees": spare})
    return sorted(fixes, key=lambda x: x["frees"], reverse=True)


def _largest_modules(window: dict | None) -> list[str]:
    if not window or "error" in window:
        return []
    return [f"{name} ({cls})" for name, cls, _ in window.get("activations_by_module", [])[:TOP_MODULES]
            if name != "(outside any module)"]
