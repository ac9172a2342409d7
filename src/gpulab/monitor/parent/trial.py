"""`gpulab profile --try num_workers=2 --steps 30 -- python train.py`: measure advice before taking it.

The script runs its first K steps (after the warm-up) as it is and with the change forced on
every DataLoader it builds, or on torch's intra-op threads in every process. One pair of runs is
not enough on a machine that is not quiet (another job, a cold page cache, a noisy neighbour move
one run's steps by more than the change does), so the runs alternate and each pair, taken side by
side in time, gives one ratio, until the latest ratios agree or the budget of pairs runs out. A
change that cannot act, or a run that ends before its steps, is refused, not measured: its ratio
would only be noise.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from gpulab.errors import UserError
from gpulab.host import usable_cores
from gpulab.io import json_bytes, writing_results
from gpulab.monitor.config import WORKERS_PER_CORE, ProfileConfig
from gpulab.monitor.analyze.step_costs import percentile, step_seconds
from gpulab.monitor.events import diagnosed_lane
from gpulab.monitor.parent.runner import job_folder, run_job

TRYABLE = {"num_workers": int, "prefetch_factor": int, "pin_memory": bool, "persistent_workers": bool, "threads": int}
WORKER_SETTINGS = ("prefetch_factor", "persistent_workers")  # DataLoader ignores them without workers

MIN_PAIRS = 2
# The ratios of the latest pairs (up to STABLE_WINDOW of them) agree when their range is at most
# this share of their median: then one more pair would not change the answer in its first digit.
STABLE_SPREAD = 0.10
STABLE_WINDOW = 3
TRY_OUTPUT = "try.json"
AS_IS = "as it is"


def parse_overrides(items: list[str]) -> dict:
    """["num_workers=2", "pin_memory=true"] -> {"num_workers": 2, "pin_memory": True}; what cannot
    be measured is refused at once."""
    overrides = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or key not in TRYABLE:
            raise UserError(f"--try {item}: use KEY=VALUE with KEY one of {', '.join(TRYABLE)}, e.g. --try num_workers=2")
        if key in overrides:  # one of the two would be measured, and the label would name both
            raise UserError(f"--try {item}: {key} is given twice: try one value at a time")
        if TRYABLE[key] is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise UserError(f"--try {item}: {key} is true or false")
            overrides[key] = text.lower() in ("true", "1")
        else:
            at_least = 1 if key in ("prefetch_factor", "threads") else 0
            if not (text.isascii() and text.isdigit()) or int(text) < at_least:
                raise UserError(f"--try {item}: {key} is a whole number{' of 1 or more' if at_least else ''}")
            overrides[key] = int(text)
    workers, threads, cores = overrides.get("num_workers"), overrides.get("threads"), usable_cores()
    # each worker is a process: 100000 of them fork until the machine gives out
    if workers is not None and workers > WORKERS_PER_CORE * cores:
        raise UserError(f"--try num_workers={workers}: this machine has {cores} usable cores, and more than "
                        f"{WORKERS_PER_CORE * cores} workers ({WORKERS_PER_CORE} per core) only compete for them: "
                        f"try num_workers={_workers_to_try()}")
    for key in WORKER_SETTINGS:
        if workers == 0 and key in overrides:
            raise UserError(f"--try {_item(key, overrides[key])} with num_workers=0: {key} only acts with "
                            f"num_workers > 0: try it with --try num_workers={_workers_to_try()}")
    if threads is not None and threads > cores:
        raise UserError(f"--try threads={threads}: this machine has {cores} usable cores, and torch's threads "
                        f"beyond them only wait for each other: try threads=1 .. {cores}")
    return overrides


def loader_settings(change: dict) -> dict:
    """A change's DataLoader arguments: all but threads, which act without a loader."""
    return {key: value for key, value in change.items() if key != "threads"}


def _workers_to_try() -> int:
    """The workers worth a first try: one per usable core but the one the training process keeps."""
    return max(1, usable_cores() - 1)


def check_change_acts(overrides: dict, loaders: list[dict]) -> None:
    """After the run as it is: a DataLoader setting where the run iterated no DataLoader, or a
    worker setting (prefetch_factor, persistent_workers) on loaders that all have num_workers=0,
    changes nothing (DataLoader ignores it), so it is refused, not measured."""
    overrides = loader_settings(overrides)
    if overrides and not loaders:
        key = next(iter(overrides))
        raise UserError(f"--try {_item(key, overrides[key])}: the script iterated no DataLoader in the run as it is, "
                        f"so a DataLoader setting changes nothing there (--try threads=N acts without one)")
    settings = [key for key in WORKER_SETTINGS if key in overrides]
    if settings and "num_workers" not in overrides and all(loader["num_workers"] == 0 for loader in loaders):
        key = settings[0]
        where = loaders[0]["where"] or "the script"
        raise UserError(f"--try {_item(key, overrides[key])}: {key} only acts with num_workers > 0, and the "
                        f"DataLoader at {where} has num_workers=0: try both, --try num_workers={_workers_to_try()} "
                        f"--try {_item(key, overrides[key])}")


def _item(key: str, value) -> str:
    """A setting as --try takes it (true, not True)."""
    return f"{key}={str(value).lower()}"


class Stopped(Exception):
    """A signal to gpulab (Ctrl-C, SIGTERM) ended a run of the trial, and so the trial: (label, exit code)."""


def try_command(command: list[str], out: Path | None, cfg: ProfileConfig, items: list[str], steps: int,
                max_pairs: int, force: bool = False) -> int:
    change = parse_overrides(items)
    if "threads" in change:  # last, as try.json names the change
        change["threads"] = change.pop("threads")
    if steps < 3:
        raise UserError(f"--steps {steps}: measure at least 3 steps (e.g. --steps 30) to see a spread")
    if not MIN_PAIRS <= max_pairs <= 50:
        raise UserError(f"--max-pairs {max_pairs}: use {MIN_PAIRS} to 50 (each pair runs the script twice)")
    label = "with " + " ".join(items)
    try:  # the output is checked before the runs: minutes of them, then nowhere to write
        with job_folder(command, out, force, [TRY_OUTPUT]) as (argv, _, outputs):
            trial = _Trial(argv, cfg, steps, outputs.path)
            trial.run_until_stable(change, label, max_pairs)
            result = trial.result(change, label)
            with writing_results():
                outputs.write({TRY_OUTPUT: json_bytes(result)})
    except Stopped as e:  # as gpulab profile ends with the job a signal ended
        label, exit_code = e.args
        print(f"gpulab profile --try: stopped during the run {label}; nothing measured is kept", file=sys.stderr)
        return exit_code
    _print(result, outputs.path)
    return 0


class _Trial:
    """The alternating runs of one --try and what they measured."""

    def __init__(self, argv: list[str], cfg: ProfileConfig, steps: int, out: Path):
        self.argv, self.cfg, self.steps, self.out = argv, cfg, steps, out
        self.times: dict[str, list[list[float]]] = {}  # label -> each run's step times
        self.ratios: list[float] = []  # per pair: as-is median / changed median

    def run_until_stable(self, change: dict, label: str, max_pairs: int) -> None:
        for pair in range(max_pairs):
            # The order alternates, so a machine getting slower (or faster) over the trial favours
            # neither side.
            order = [(AS_IS, {}), (label, change)]
            for run_label, run_change in order if pair % 2 == 0 else order[::-1]:
                times, loaders = self._measure(run_change, run_label)
                self.times.setdefault(run_label, []).append(times)
                if pair == 0 and run_label == AS_IS:
                    check_change_acts(change, loaders)
            self.ratios.append(statistics.median(self.times[AS_IS][-1]) / statistics.median(self.times[label][-1]))
            if stable(self.ratios):
                return

    def _measure(self, change: dict, label: str) -> tuple[list[float], list[dict]]:
        """Run the first steps with `change`: the measured steps' times, and the loaders the
        diagnosed process iterated."""
        warmup = self.cfg.warmup_steps
        # Steps only: a measurement window's steps carry its profiler's cost, and would be some of
        # the K measured.
        cfg = replace(self.cfg, stop_after_steps=warmup + self.steps, dataloader_overrides=loader_settings(change),
                      torch_threads=change.get("threads", 0), kernel_window_steps=0, memory_window=False,
                      operators_window=False)
        job = run_job(self.argv, cfg, self.out)
        if job.stopped and job.hang is None:
            raise Stopped(label, job.exit_code)
        lane = diagnosed_lane(job.lanes, job.pid)
        steps = len(lane.steps) if lane else 0
        times = [step_seconds(s) for s in lane.steps[warmup:]] if lane else []
        # A run that reached its steps may still exit non-zero: under torchrun a rank that leaves at
        # once can fail a peer's collective. One that did not reach them measured too little.
        if len(times) < self.steps:
            asked = f"its {warmup} steps of warm-up and {self.steps} measured (--steps {self.steps})"
            if job.exit_code != 0:
                ended = "hung and was stopped" if job.hang else f"failed (exit code {job.exit_code})"
                raise UserError(f"--try: the run {label} {ended} after {steps} steps, before {asked}: see why "
                                f"with gpulab profile -- {' '.join(self.argv)}")
            fix = f"use --steps {steps - warmup} or fewer" if steps - warmup >= 3 else "it runs too few steps to measure"
            raise UserError(f"--try: the script ended after {steps} steps, before {asked}: {fix}")
        return times, lane.loaders

    def result(self, change: dict, label: str) -> dict:
        before = _distribution([t for run in self.times[AS_IS] for t in run])
        after = _distribution([t for run in self.times[label] for t in run])
        reliable = stable(self.ratios)
        window = self.ratios[-STABLE_WINDOW:] if reliable else self.ratios
        result = {"overrides": change, "steps": self.steps, "warmup_steps": self.cfg.warmup_steps,
                  "runs": {AS_IS: before, label: after},
                  "pairs": [round(r, 4) for r in self.ratios],
                  "speedup": round(statistics.median(window), 3),
                  "spread": [round(min(self.ratios), 3), round(max(self.ratios), 3)],
                  "reliable": reliable}
        result["verdict"] = verdict(before, after) if reliable else unreliable_verdict(self.ratios)
        return result


def unreliable_verdict(ratios: list[float]) -> str:
    """Pairs that never agreed: their spread, and the direction where every pair points the same
    way (a busy machine can swing the size of a gain from 1.06x to 1.88x and still show it in
    every pair: 5 of 5 by chance alone is a 1-in-16 event)."""
    spread = f"spread {min(ratios):.2f}x .. {max(ratios):.2f}x over {len(ratios)} pairs of runs"
    if min(ratios) > 1 or max(ratios) < 1:
        direction = "faster" if min(ratios) > 1 else "slower"
        return (f"not reliable in size: {spread}, but {direction} in every pair - rerun on a quieter machine or "
                f"with more --steps for its size")
    return f"not reliable: {spread} - the machine's noise is larger than the change; rerun on a quieter machine or with more --steps"


def stable(ratios: list[float]) -> bool:
    """Do the latest pairs' ratios agree (at least MIN_PAIRS of them)?"""
    if len(ratios) < MIN_PAIRS:
        return False
    window = ratios[-STABLE_WINDOW:]
    return (max(window) - min(window)) <= STABLE_SPREAD * statistics.median(window)


def verdict(before: dict, after: dict) -> str:
    """"faster" or "slower" only when the change moves the median out of the other run's p10-p90
    range; a difference inside the step-to-step spread is no measured effect."""
    if after["median_s"] < before["p10_s"]:
        return "faster"
    if after["median_s"] > before["p90_s"]:
        return "slower"
    return "within the spread of the steps: no clear change"


def _distribution(times: list[float]) -> dict:
    return {"steps": len(times), "median_s": statistics.median(times), "p10_s": percentile(times, 0.1),
            "p90_s": percentile(times, 0.9)}


def _print(result: dict, out: Path) -> None:
    console = Console(stderr=True, highlight=False, soft_wrap=True)
    pairs = len(result["pairs"])
    console.print(f"\n[bold]gpulab profile --try[/]: step time over {result['steps']} steps after "
                  f"{result['warmup_steps']} of warm-up, {pairs} pairs of runs taken in turn "
                  f"(median \\[p10 .. p90] of all their steps)")
    for label, d in result["runs"].items():
        console.print(f"  {label:<32} {d['median_s'] * 1e3:8.2f} ms  \\[{d['p10_s'] * 1e3:.2f} .. {d['p90_s'] * 1e3:.2f}]")
    console.print("  each pair's ratio: " + ", ".join(f"{r:.2f}x" for r in result["pairs"]))
    if result["reliable"]:
        console.print(f"  the change makes each step [bold]{result['speedup']:.2f}x[/] ({result['verdict']}); "
                      f"wrote {out}/try.json")
    else:
        console.print(f"  [bold]{result['verdict']}[/] (median {result['speedup']:.2f}x); wrote {out}/try.json")
