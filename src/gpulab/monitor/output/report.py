"""The outputs of a session: report.json, timeline.png, trace.json, and the short terminal report."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from gpulab.monitor.output import OUTPUTS, timeline, trace
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.analyze.compiled import compile_summary, compiles_line
from gpulab.monitor.analyze.diagnose import diagnose
from gpulab.monitor.alive.failure import failure_finding, job_failure
from gpulab.monitor.alive.hang import hang_finding
from gpulab.monitor.alive.stall import find_stalls, stall_finding
from gpulab.monitor.analyze.memory_findings import memory_line, memory_summary, oom_finding
from gpulab.monitor.analyze.step_costs import lane_summary, phases_text, step_seconds
from gpulab.monitor.analyze.process import weight_in_the_steps
from gpulab.monitor.analyze.ranks import rank_findings
from gpulab.monitor.events import Recording, by_rank, diagnosed_lane, trainers
from gpulab.io import OutputFolder, json_bytes

ENVIRONMENT_KEYS = ("python", "torch", "torch_cuda_build", "cpu_count", "torch_threads")


def build_report(lanes: list[Recording], main_pid: int | None, samples: list[dict], gpus: list[dict], sampler: dict,
                 cfg: ProfileConfig, exit_code: int | None, hang: dict | None = None,
                 stalls: list[dict] | None = None, stopped: bool = False,
                 suspended: list[tuple[float, float]] = ()) -> tuple[dict, list[Recording]]:
    """The report of a job of one or more processes (an in-process session is a job of one), and
    the processes to draw: the diagnosed one first (events.diagnosed_lane: the parent's evaluation
    loop is not the verdict), then the others that trained. `hang`, `stalls`: what the parent's
    hang watch saw; `stopped`: gpulab stopped the job (a hang, or the user's signal to gpulab);
    `suspended`: when the user stopped the job at the terminal.

    diagnose()'s keys come first (steps, step_time_s, phases, devices, findings), then the evidence."""
    main = next((r for r in lanes if r.pid == main_pid), None)
    trained = trainers(lanes)
    shown = diagnosed_lane(lanes, main_pid) or Recording([])
    report = diagnose(shown, samples, gpus, cfg.warmup_steps)
    report.update({
        "memory": memory_summary(shown),
        "compile": compile_summary(shown),
        "command": shown.start.get("command"),
        "exit_code": exit_code,
        "complete": shown.end is not None and exit_code == 0,
        "error": (shown.end or {}).get("error"),
        "syncs": sorted(shown.sites, key=weight_in_the_steps, reverse=True),
        "data_loaders": [_fields(r) for r in shown.loaders],
        "kernel_window": _fields(shown.kernels) if shown.kernels else None,
        "hot_lines": shown.hot,
        "hot_steps": shown.hot_steps,
        "hot_blocked": shown.hot_blocked,
        "hot_line_interval_s": shown.hot_interval_s,
        "cuda": shown.cuda,
        "environment": {k: shown.start.get(k) for k in ENVIRONMENT_KEYS},
        "sampler": sampler,
        "config": cfg.to_dict(),
        "diagnosed_pid": shown.pid,
        "processes": [{**lane_summary(r, cfg.warmup_steps), "role": _role(r, main_pid)}
                      for r in by_rank(lanes) if r.recorded and not r.is_dataloader_worker],
    })
    oom = oom_finding(shown, who=_who(shown, main_pid) if shown is not main and shown.pid is not None else None)
    failure = job_failure(lanes, stopped, main_pid, exit_code)
    # a failure ends the steps worth judging across ranks: the survivors' last steps wait for the dead
    across = rank_findings(lanes, cfg.warmup_steps, until=failure["first"]["t"] if failure else None)
    if oom is None:  # another process ran out
        across += [f for r in lanes if r is not shown and (f := oom_finding(r, who=_who(r, main_pid))) is not None]
    found_stalls = find_stalls(lanes, cfg.warmup_steps, stalls or [], timeline.time_origin(lanes, samples), suspended)
    run_seconds = sum(step_seconds(s) for s in shown.steps)
    across += [stall_finding(s, run_seconds) for s in found_stalls]
    note = _note(shown, main, trained)
    if note:
        report["note"] = note
    elif not shown.recorded:  # said in diagnose's own finding, before any other is ranked above it
        report["findings"][0]["evidence"], report["findings"][0]["fix"] = _why_nothing_was_recorded(main)
    # The findings ranked, here alone: what ended the job first (a hang, else a failure, else running out of
    # memory), then the diagnosed process's own (diagnose's order) with those across processes among them by
    # share. A "none" stands only alone.
    findings = report["findings"]
    if oom is not None:
        findings = [oom] + _real(findings)
    if across:
        findings = sorted(across + _real(findings), key=lambda f: f["share"], reverse=True)
    report["stalls"] = found_stalls
    ended = None
    if failure is not None:
        report["failure"] = failure
        report["error"] = failure["first"]["message"]
        # several processes: which failed first; none that trained: the steps' shares say nothing
        if (len(trained) > 1 or not trained) and not any(f["cause"] == "out_of_memory" for f in findings):
            ended = failure_finding(failure)
    if hang is not None:
        report["hang"] = hang
        ended = hang_finding(hang)  # in place of the failure's
    report["findings"] = [ended] + _real(findings) if ended else findings
    return report, [shown] + [r for r in trained if r is not shown]


def _note(shown: Recording, main: Recording | None, trained: list[Recording]) -> str | None:
    """Which process the diagnosis is of, where that is not simply the script's."""
    ranks = sum(r.rank is not None for r in trained)
    if shown.rank is not None and (shown is not main or ranks > 1):  # under Lightning the script itself is rank 0
        return (f"{ranks} ranks trained; below, rank {shown.rank}'s steps, then findings across ranks "
                f"(straggler, communication-bound, unbalanced data) and rank {shown.rank}'s own")
    if shown is not main and shown.pid is not None:
        return (f"the training ran in {len(trained)} child process(es); the diagnosis is of pid {shown.pid} "
                f"({len(shown.steps)} steps), the others are listed under processes")
    return None


def _real(findings: list[dict]) -> list[dict]:
    """All but "none" (nothing stands out), which gives way to any other finding."""
    return [f for f in findings if f["cause"] != "none"]


def _who(rec: Recording, main_pid: int) -> str:
    """'rank 1 (pid 4242)', 'pid 4242 (child of 4200)': a process of the job, as a finding names it."""
    role = _role(rec, main_pid)
    return f"{role} (pid {rec.pid})" if role.startswith("rank") else f"pid {rec.pid} ({role})"


def _role(rec: Recording, main_pid: int) -> str:
    if rec.rank is not None:
        return f"rank {rec.rank}"
    return "main" if rec.pid == main_pid else f"child of {rec.start.get('ppid')}"


def _why_nothing_was_recorded(main: Recording | None) -> tuple[str, str]:
    """(what happened, what to do) when no process of the job recorded anything."""
    if main is None:
        return ("the script's Python did not run gpulab's start-up hook, so nothing was recorded",
                "start the script with a Python interpreter directly (gpulab profile -- python script.py), "
                "not through a program that clears PYTHONPATH")
    error = main.process.get("error")
    if error:
        return (f"the script's Python ({main.process.get('executable')}) could not load gpulab's recorder: {error}",
                "profile with a Python that has gpulab and its dependencies installed (pip install gpulab in the "
                "script's environment)")
    return "the script never imported torch: there was nothing to record", "profile a script that trains with torch"


def _fields(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "type"}


def write_outputs(out: OutputFolder, report: dict, lanes: list[Recording], samples: list[dict], gpus: list[dict],
                  title: str) -> None:
    """Write the three outputs, each atomically (a reader never sees half a file), report.json
    first: on a full disk it is the one worth keeping. Only over files gpulab wrote (OutputFolder)."""
    events = trace.build(lanes, samples, gpus, timeline.time_origin(lanes, samples))
    out.write({"report.json": json_bytes(report),
               "timeline.png": timeline.render(lanes, samples, gpus, report, title),
               "trace.json": json.dumps(events, separators=(",", ":")).encode()})


def print_report(report: dict, out: Path, console: Console | None = None) -> None:
    console = console or Console(stderr=True, highlight=False, soft_wrap=True)
    for line in terminal_lines(report, out):
        console.print(line)


def terminal_lines(report: dict, out: Path) -> list[str]:
    """The short human report: step time, where it goes, the findings with evidence, where and fix."""
    step, lines = report["step_time_s"], [""]
    head = f"[bold]gpulab profile[/]: {report['steps']} steps"
    if report["steps"]:
        head += (f" ({report['steady_steps']} measured; {report['steps_found']}), median step "
                 f"{step['median'] * 1e3:.1f} ms, p90 {step['p90'] * 1e3:.1f} ms")
    if report.get("exit_code"):
        head += f"  [yellow](script exited with {report['exit_code']}: partial report)[/]"
    lines.append(head)
    if report.get("note"):
        lines.append(f"  [dim]{escape(report['note'])}[/]")
    trained = [p for p in report.get("processes", []) if p["steps"]]  # ranks already in rank order
    if len(trained) > 1:
        for p in trained:
            median = f", median {p['median_step_s'] * 1e3:.1f} ms" if p["median_step_s"] else ""
            lines.append(f"  [dim]pid {p['pid']} ({p['role']}): {p['steps']} steps{median}  "
                         f"{phases_text(p['phases'] or {})}[/]")
    phases = phases_text(report["phases"])
    busy = report.get("device_busy")
    if busy:
        phases += f"   device busy {busy['share']:.0%} ({escape(busy['source'])})"
    lines.append(f"  step time: {phases}")
    later = report.get("later_steps")
    if later:
        lines.append(f"  [dim]the {later['steps']} steps after the first {later['from_step']} (summed, not judged step "
                     f"by step): median {later['median_step_s'] * 1e3:.2f} ms, p90 {later['p90_step_s'] * 1e3:.2f} ms  "
                     f"{phases_text(later['phases'])}[/]")
    if report.get("memory"):
        lines.append(f"  {escape(memory_line(report['memory']))}")
    if report.get("compile"):
        c = report["compile"]
        lines.append(f"  torch.compile: {compiles_line(c)}, {c['seconds']:.1f} s (recompiles "
                     f"{c['recompile_seconds']:.1f} s), {sum(g['count'] for g in c['graph_breaks'])} graph breaks "
                     "- apart from the steady steps")
    for missing in report.get("not_measured", []):
        lines.append(f"  [yellow]not measured:[/] {escape(missing)}")
    for n, f in enumerate(report["findings"], 1):
        if f["cause"] == "none":
            nothing = not report["steps"] and not report.get("device_busy")
            head = "[bold yellow]nothing to diagnose[/]" if nothing else "[bold green]no bottleneck stands out[/]"
            lines.append(f"  {head}: {escape(f['evidence'])}")
            lines.append(f"     [dim]{'fix' if nothing else 'next'}:[/]  {escape(f['fix'])}")
            continue
        share = f"[red]{f['share']:.0%}[/] of {f.get('share_of', 'step time')}"
        if f.get("share_of", "").startswith("not timed"):
            share = f"[dim]({escape(f['share_of'])})[/]"
        rank = f" (rank {f['rank']})" if f.get("rank") is not None else ""
        lines.append(f"  [bold]{n}. {f['cause']}[/] {share}{rank}")
        lines.append(f"     [dim]evidence:[/] {escape(f['evidence'])}")
        if f["where"]:
            lines.append(f"     [dim]where:[/]    {escape(f['where'])}")
        if f.get("support"):
            lines.append(f"     [dim]based on:[/] {escape(f['support'])}")
        lines.append(f"     [dim]fix:[/]      {escape(f['fix'])}")
    syncs = [s for s in report.get("syncs", []) if s["kind"] == "sync"]
    if syncs and not any(f["cause"] == "host_sync" for f in report["findings"]):
        top = syncs[0]
        lines.append(f"  [dim]host syncs seen (cost under the threshold): {'/'.join(top['ops'])} at "
                     f"{escape(str(top['where']))}, {top['count']} calls[/]")
    lines.append(f"  wrote {escape(str(out))}/{{{', '.join(OUTPUTS)}}} (open trace.json in ui.perfetto.dev)")
    return lines
