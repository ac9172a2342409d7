"""torch.compile as a cause, from the "compile" records (record/probes/compiled.py), each finding
with the script's line and the fix. Steps that compiled are left out of the steady steps
(step_costs.select_steady): what they cost is here, as a share of the run.

    compile_time    seconds spent compiling (first compiles, recompiles, backward's lazy compile,
                    CUDA graph recordings), named at MIN_SHARE of the run
    recompile       a compiled function compiled again: the guard that failed (a new input size,
                    a Python number that changed, a dtype), the line that called it
    graph_break     the line that broke a compiled graph, and torch's reason
    cudagraph_skip  (CUDA, mode="reduce-overhead") CUDA graphs not used, and why
    cudagraph_rerecord  (CUDA) a CUDA graph recorded again because what it reads moved (a parameter
                    replaced, an earlier replay's output kept); past torch's limit, no graphs
The last three are not timed apart (share 0): they are named whatever their cost.
"""

from __future__ import annotations

import re

from gpulab.monitor.analyze.findings import MIN_SHARE, finding
from gpulab.monitor.events import Recording

MAX_LISTED = 5  # recompile groups, graph breaks and skips named, each

# A recompile's guard failure -> the fix (torch 2.13's wording of the guards).
_RECOMPILE_FIXES = (
    (re.compile(r"size mismatch at index (\d+)"), lambda m: (
        f"the input's size at dimension {m[1]} changes: keep it fixed (DataLoader(drop_last=True) - under Hugging "
        f"Face's Trainer TrainingArguments(dataloader_drop_last=True) - or pad to one size), "
        f"or tell torch it varies - torch._dynamo.mark_dynamic(x, {m[1]}) before the call, or "
        "torch.compile(..., dynamic=True)")),
    (re.compile(r"dtype mismatch"), lambda m: "the input's dtype changes: give the compiled code one dtype"),
    (re.compile(r"requires_grad mismatch"), lambda m: (
        "an input's requires_grad changes between calls: keep it the same (or detach the input)")),
    (re.compile(r"(?:==|!=) -?[\d.e+-]+$|type\(.*\) .* float|___check_type_id"), lambda m: (
        "a Python number (or object) the compiled code reads changed, and each value is a constant of its "
        "own graph: pass it as a tensor (torch.tensor(value)) so that one graph serves every value")),
    (re.compile(r"(?:^|; )self\.(?!training\b)[\w.]+ (?:==|!=|is) "), lambda m: (
        "an attribute of the module (self....) that the compiled code reads changed between calls, and each value "
        "is a constant of its own graph: set it once before the first call (a config value, e.g. "
        "config.problem_type), and keep per-step Python state out of the compiled function (a callback, a logger)")),
    (re.compile(r"\.training"), lambda m: (
        "the module switched between train() and eval(): one compile for each mode is expected; compile "
        "the evaluation separately if it recompiles every epoch")),
    (re.compile(r"grad_mode|GLOBAL_STATE"), lambda m: (
        "the call switched between grad and no_grad: one compile for each is expected")),
)
_GRAPH_BREAK_FIXES = (
    (re.compile(r"\.item\(\)|capture_scalar_outputs"), (
        "keep the value on the device (no .item() inside the compiled code: use the tensor), or let torch "
        "trace it: torch._dynamo.config.capture_scalar_outputs = True")),
    (re.compile(r"\bprint\b|builtin.*print|logging", re.I), (
        "move the print or logging out of the compiled code (log every N steps, outside it)")),
    (re.compile(r"data.dependent|generic_jump|Data-dependent branching", re.I), (
        "a Python `if` on a tensor's value: compute both sides and pick with torch.where (or torch.cond)")),
    (re.compile(r"\.numpy\(\)|\.tolist\(\)|\.cpu\(\)"), (
        "a read of the tensor's values into Python: keep the computation in torch inside the compiled code")),
)
_CUDAGRAPH_FIXES = (
    (re.compile(r"mutated input", re.I), (
        "the compiled code writes into one of its inputs in place: write into a new tensor (out = x + 1, "
        "not x.add_(1)), or clone the input first")),
    (re.compile(r"cpu (device|tensor)|non-cuda|cpu", re.I), (
        "a CPU tensor enters the compiled code: move it to the GPU before the call (CUDA graphs replay "
        "GPU work only)")),
    (re.compile(r"dynamic shape", re.I), (
        "the input's shape varies: keep it fixed (each shape records a graph of its own)")),
)
_RERECORD_FIXES = (
    (re.compile(r"static input data pointer changed"), (
        "a parameter or buffer the graph reads is a new tensor since it was recorded (reassigned, or loaded with "
        "load_state_dict(assign=True)): update it in place (p.copy_(new)) so that the graph reads the same memory")),
    (re.compile(r"cudagraph managed tensor data pointer changed|expected dead indices", re.I), (
        "an output of an earlier replay is still in use when the next replay starts: mark each step "
        "(torch.compiler.cudagraph_mark_step_begin()) and clone the outputs you keep across steps (out.clone())")),
)


def compile_summary(rec: Recording) -> dict | None:
    """The compile records in numbers: report.json's "compile"."""
    if not rec.compiles:
        return None
    compiles = [r for r in rec.compiles if r["kind"] == "compile"]
    first = [r for r in compiles if _attempt(r) == 0]
    again = [r for r in compiles if _attempt(r) > 0]
    by_trigger = {t: [r for r in compiles if r["trigger"] == t] for t in sorted({r["trigger"] for r in compiles})}
    return {
        # as torch counts them: frames compiled (dynamo's, recompiles included), and apart from them
        # AOTAutograd's compiles of a backward and inductor's CUDA graph recordings
        "compiles": len(by_trigger.get("dynamo", [])),
        "backward_compiles": len(by_trigger.get("lazy_backward", [])),
        "cudagraph_recordings": len(by_trigger.get("cudagraph_recording", [])),
        "seconds": round(_seconds(compiles), 3),
        "first_compile_seconds": round(_seconds(first), 3),
        "recompile_seconds": round(_seconds(again), 3),
        "by_trigger": {t: round(_seconds(records), 3) for t, records in by_trigger.items()},
        "recompiles": _grouped(rec, "recompile", ("where", "function", "defined_at", "reason"), "compile_id"),
        "graph_breaks": _grouped(rec, "graph_break", ("where", "reason")),
        "cudagraph_skips": _grouped(rec, "cudagraph_skip", ("where", "reason")),
        "cudagraph_rerecords": _grouped(rec, "cudagraph_rerecord", ("where", "function", "reason")),
    }


def compile_findings(rec: Recording, run_seconds: float) -> list[dict]:
    """A finding per compile cause (module docstring); shares are of the run (`run_seconds`)."""
    summary = compile_summary(rec)
    if summary is None:
        return []
    findings = []
    run = max(run_seconds, summary["seconds"], 1e-9)
    share = summary["seconds"] / run
    if share >= MIN_SHARE:
        findings.append(finding(
            "compile_time", share, _compile_time_evidence(summary), _first_call_line(rec), share_of="the run",
            fix=("compiling is paid once per shape and process: run long enough to win it back, keep shapes fixed so "
                 "it happens once (see the recompiles), and keep torch's compile cache (TORCHINDUCTOR_CACHE_DIR, on by "
                 "default) between runs: a second run compiles in a fraction of the time")))
    findings += [_recompile_finding(rec, group, run) for group in summary["recompiles"][:MAX_LISTED]]
    for key, cause, evidence, rules, default, share_of in _UNTIMED:
        findings += [finding(cause, 0.0, evidence(group), group["where"], fix=_fix(rules, group["reason"], default),
                             share_of=share_of) for group in summary[key][:MAX_LISTED]]
    return findings


# The causes not timed apart: (summary key, cause, evidence, fixes, default fix, what a share would be of).
_UNTIMED = (
    ("graph_breaks", "graph_break",
     lambda g: (f"torch.compile breaks the graph at this line ({_times(g['count'])} while compiling; every call then "
                f"runs the compiled code in pieces): {g['reason']}"),
     _GRAPH_BREAK_FIXES, "rewrite that line in torch ops, or wrap it in torch.compiler.disable",
     "not timed: the compiled code runs in pieces with Python between them"),
    ("cudagraph_skips", "cudagraph_skip", lambda g: f"CUDA graphs not used {_times(g['count'])}: {g['reason']}",
     _CUDAGRAPH_FIXES, "see torch's reason: the compiled code cannot be replayed as a graph",
     "not timed: the step runs kernel by kernel instead of as one replay"),
    ("cudagraph_rerecords", "cudagraph_rerecord",
     lambda g: (f"the CUDA graph of {g['function'] or 'the compiled code'} was recorded again "
                f"{_times(g['count'])}: {g['reason']}"),
     _RERECORD_FIXES, "see torch's reason: what the graph reads moved",
     "not timed apart: recordings are in compile_time's CUDA graph recording seconds"),
)


def _recompile_finding(rec: Recording, group: dict, run: float) -> dict:
    """A recompile's seconds: every compile of its id (forward, and backward's lazy compile)."""
    ids = set(group["compile_ids"])
    seconds = _seconds(r for r in rec.compiles if r["kind"] == "compile" and r.get("compile_id") in ids)
    evidence = (f"{_compiled_code(group)} called here compiled again {_times(group['count'])} ({seconds:.2f} s); "
                f"the guard that failed: {group['reason']}")
    fix = _fix(_RECOMPILE_FIXES, group["reason"], "keep what the failed guard checks the same between calls")
    return finding("recompile", seconds / run, evidence, group["where"], fix=fix, share_of="the run")


def _compiled_code(group: dict) -> str:
    """The function that recompiled, with its own line where that is not the line calling it (a
    framework's `trainer.fit` calls the user's compiled `training_step`)."""
    function, defined_at = group.get("function"), group.get("defined_at")
    if not function:
        return "the compiled code"
    if defined_at and defined_at != group.get("where"):
        return f"the compiled {function} ({defined_at})"
    return f"the compiled {function}"


def _compile_time_evidence(summary: dict) -> str:
    parts = [f"compiling took {summary['seconds']:.1f} s: {compiles_line(summary)}; first compiles "
             f"{summary['first_compile_seconds']:.1f} s, recompiles {summary['recompile_seconds']:.1f} s"]
    if "lazy_backward" in summary["by_trigger"]:
        parts.append(f"backward's own compiles {summary['by_trigger']['lazy_backward']:.1f} s of it")
    if "cudagraph_recording" in summary["by_trigger"]:
        parts.append(f"CUDA graph recordings {summary['by_trigger']['cudagraph_recording']:.1f} s")
    return "; ".join(parts) + " (left out of the steady steps)"


def compiles_line(summary: dict) -> str:
    """"3 frames compiled (1 a recompile), 1 backward, 2 CUDA graph recordings": torch's counts."""
    recompiles = sum(g["count"] for g in summary["recompiles"])
    text = f"{summary['compiles']} frame{'s' * (summary['compiles'] != 1)} compiled"
    if recompiles:
        text += f" ({recompiles} {'a recompile' if recompiles == 1 else 'recompiles'})"
    if summary["backward_compiles"]:
        text += f", {summary['backward_compiles']} backward"
    if summary["cudagraph_recordings"]:
        n = summary["cudagraph_recordings"]
        text += f", {n} CUDA graph recording{'s' * (n != 1)}"
    return text


def _first_call_line(rec: Recording) -> str | None:
    return next((r["where"] for r in rec.compiles if r["kind"] == "compile" and r.get("where")), None)


def _attempt(record: dict) -> int:
    """The attempt in a compile id "frame/attempt" (0: the frame's first compile)."""
    _, _, attempt = (record.get("compile_id") or "").partition("/")
    return int(attempt) if attempt.isdigit() else 0


def _seconds(records) -> float:
    return sum(r["t1"] - r["t0"] for r in records)


def _grouped(rec: Recording, kind: str, keys: tuple[str, ...], collect: str | None = None) -> list[dict]:
    """The records of `kind` that say the same (`keys`), counted (and `collect`'s values listed, as
    "<collect>s"); most frequent first."""
    groups: dict[tuple, dict] = {}
    for r in [r for r in rec.compiles if r["kind"] == kind]:
        key = tuple(r.get(k) for k in keys)
        group = groups.setdefault(key, {**{k: r.get(k) for k in keys}, "count": 0,
                                        **({f"{collect}s": []} if collect else {})})
        group["count"] += 1
        if collect:
            group[f"{collect}s"].append(r.get(collect))
    return sorted(groups.values(), key=lambda g: g["count"], reverse=True)


def _times(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _fix(rules, reason: str | None, default: str) -> str:
    for pattern, fix in rules:
        m = pattern.search(reason or "")
        if m:
            return fix(m) if callable(fix) else fix
    return default
