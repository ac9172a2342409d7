"""The front door of the analysis: one process's recording and the samples taken beside it ->
the report's core (diagnose).

    step_costs.py  steady steps and what they are made of    devices.py   samples, device busy
    process.py   the per-process rules                       ranks.py     the cross-rank rules
    findings.py  the finding record and the fixes            contention.py  threads waiting for a core
"""

from __future__ import annotations

import statistics

from gpulab.monitor.analyze.compiled import compile_findings
from gpulab.monitor.analyze.contention import core_use
from gpulab.monitor.analyze.devices import device_busy, not_measured, summarize_devices, used_gpu_indices
from gpulab.monitor.analyze.findings import finding
from gpulab.monitor.analyze.step_costs import (PHASE_NAMES, StepCosts, aggregate_summary, operators_as_compute,
                                               percentile, recorded_seconds, select_steady, step_seconds, steps_found)
from gpulab.monitor.analyze.process import costly_transforms, process_findings
from gpulab.monitor.events import DDP_WAIT_COUNT, Recording


def diagnose(rec: Recording, samples: list[dict], gpus: list[dict], warmup_steps: int) -> dict:
    """The report's core: steps, step time, phase shares, device summaries and ranked findings."""
    steady, excluded = select_steady(rec.steps, warmup_steps)
    # No optimizer step at all (it crashed first, or it is not a training loop): judge the run.
    whole_run = bool(not steady and rec.tail and rec.tail["t1"] > rec.tail["t0"])
    steady = [rec.tail] if whole_run else steady
    used = used_gpu_indices(rec, gpus)
    window = (steady[0]["t0"], steady[-1]["t1"]) if steady else None
    report = {
        "steps": rec.steps_done,
        "steps_found": steps_found(rec),
        "step_time_s": {"median": 0.0, "p90": 0.0},
        "phases": dict.fromkeys(PHASE_NAMES, 0.0),
        "devices": summarize_devices(samples, gpus, used, window, rec.start),
        "findings": [],
        "steady_steps": 0 if whole_run else len(steady),
        "excluded_steps": excluded,
        "not_measured": not_measured(rec, gpus, used),
    }
    # torch.compile's causes are the run's, not the loop's: drawn however few steps there were
    compiled = compile_findings(rec, recorded_seconds(rec))
    if not steady:
        report["findings"] = with_compile_findings(
            [finding("none", 0.0, f"no training step was recorded: {steps_found(rec)}", None, "no_steps")], compiled)
        return report
    if not whole_run:
        durations = [step_seconds(s) for s in steady]
        report["step_time_s"] = {"median": round(statistics.median(durations), 6),
                                 "p90": round(percentile(durations, 0.9), 6)}
    operator_share, operator_lines = operators_as_compute(rec)
    step = StepCosts(steady, operator_share)
    report["phases"] = step.shares()
    if operator_share:
        report["operators_outside_modules"] = {
            "ms_per_step": round(step.operators * 1e3, 3), "lines": operator_lines,
            "source": "lines whose time is mostly torch functions and tensor methods called outside any "
                      "nn.Module (a forward written with torch functions), found in a window of steps: compute, "
                      "as a module's forward would be"}
    later = aggregate_summary(rec)
    if later is not None:  # the shares and findings above are of the detailed window
        report["later_steps"] = later
    if step.collectives > 0:
        report["collectives"] = collectives_summary(step)
    busy, busy_source = device_busy(rec, step, samples, gpus, used, window)
    report["device_busy"] = {"share": round(min(busy / step.seconds, 1.0), 4) if step.seconds else 0.0,
                             "source": busy_source}
    cores = core_use(samples, window)
    if cores is not None:
        report["cores"] = cores.summary()
    if not whole_run and all(s["i"] < warmup_steps for s in steady):
        # Every step past the warm-up ran inside a measurement window (the run ended in one, an
        # out-of-memory error say): warm-up steps carry CUDA's start-up and gpulab's own windows'
        # set-up, and no finding about the loop is drawn from them.
        too_few = finding("none", 0.0, f"no step after the warm-up ran outside gpulab's measurement windows "
                          f"({len(steady)} warm-up step(s), {excluded['profiler_window']} measured for kernels, "
                          f"memory, transforms or operators): too few steps to judge the loop", None, "too_few_steps")
        report["findings"] = with_compile_findings([too_few], compiled)
    else:
        findings = process_findings(rec, step, busy, busy_source, gpus, used, cores)
        if whole_run:
            whole = f"no training step ({steps_found(rec)}), so these shares are of the whole run; "
            for f in findings:
                f["evidence"] = whole + f["evidence"]
        report["findings"] = with_compile_findings(findings, compiled)
    report["transforms"] = costly_transforms(rec, step)
    return report


def with_compile_findings(findings: list[dict], compiled: list[dict]) -> list[dict]:
    """torch.compile's causes after the loop's (graph breaks are not timed: no share to rank them
    by); a "none" gives way to them."""
    if not compiled:
        return findings
    return [f for f in findings if f["cause"] != "none"] + compiled


def collectives_summary(step: StepCosts) -> dict:
    share = round(step.collectives / step.seconds, 4) if step.seconds else 0.0
    summary = {"ms_per_step": round(step.collectives * 1e3, 3), "share": share,
               "source": "torch.distributed calls and waits timed by gpulab"}
    if DDP_WAIT_COUNT in step.counts:
        summary["ddp_backward_wait_ms_per_step"] = round(step.counts[DDP_WAIT_COUNT] * 1e3, 3)
        summary["source"] += ("; DDP's wait for its allreduce inside backward: from its last gradient (a hook on "
                              "each parameter) to the end of backward, at every step")
    return summary
