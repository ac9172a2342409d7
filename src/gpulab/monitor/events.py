"""The recording format, read back: one JSON-lines file per recorded process.

Written by the recorder (record/) inside each process of the profiled job, read in `gpulab
profile`'s own process. No torch here: the parent must not pay for it (2-3 s) nor change the
script's environment.

A process's file holds, in order of writing, the records typed below (TypedDicts: the JSON
objects themselves, so writing and reading cost nothing extra): process, start, rank (once
torch.distributed's default group is up), loader*, rule*, cuda (once the GPU is used), compile*,
then step*/fold*, kernels (CUDA), memory, block* (the steps after the detailed window, summed),
tail, oom, end; and the whole-run tallies sites, hot, spans, facts, loader_use, rewritten at
every flush (the last one wins). Reading goes line by line and merges blocks down to MAX_BLOCKS:
a recording of any length is read in bounded memory.

perf_counter() is CLOCK_MONOTONIC on Linux and macOS: one clock for every process of a machine,
so lanes line up without translation.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal, NotRequired, TypedDict

from gpulab.memory.records import OutOfMemory, StepMemory
from gpulab.monitor.alive.protocol import read_tally, tally_file

CATEGORIES = ("data_wait", "h2d", "compute", "collective", "sync", "compile", "other")
EVENTS_PREFIX = "events-"
TRANSFORM_PREFIX = "transform: "  # a step's count of seconds in one transform inside a DataLoader fetch
OPS_SPAN = "torch operators outside modules"  # the operators window's compute spans (record/probes/ops.py)
DDP_WAIT_COUNT = "ddp_wait_s"  # a step's count of seconds DDP waited for its allreduce inside backward
# A step's count of seconds spent starting passes over DataLoaders - each pass's iter() and its
# first batch, where the workers start - and of the passes started:
PASS_START_COUNT = "pass_start_s"
PASSES_COUNT = "passes"


class ProcessRecord(TypedDict):
    """Written at interpreter start-up (autostart/sitecustomize.py), or when a forked child
    becomes its own lane; `error`: what kept the recorder from loading."""
    type: Literal["process"]
    pid: int
    ppid: int
    t: float
    argv: list[str]
    error: str | None
    executable: NotRequired[str]
    forked: NotRequired[bool]


class StartRecord(TypedDict):
    """The recorder started: the process imported torch."""
    type: Literal["start"]
    t: float
    pid: int
    ppid: int
    rank: int | None
    local_world_size: int | None  # ranks sharing this machine's cores
    world_size: int | None
    command: list[str]
    python: str
    torch: str
    torch_cuda_build: str | None
    cpu_count: int | None
    torch_threads: int
    config: dict  # ProfileConfig


class RankRecord(TypedDict):
    """torch.distributed's default group is up: its rank, whoever launched it (torchrun sets RANK
    before start; Lightning, mp.spawn and others pass it to init_process_group)."""
    type: Literal["rank"]
    t: float
    rank: int
    world_size: int


class LoaderRecord(TypedDict):
    """A DataLoader the process iterated (the same settings re-made each epoch are one)."""
    type: Literal["loader"]
    where: str | None  # the user's line that iterated it (under a framework: the line that called it, trainer.fit)
    # The user's line that built it; for a framework's copy, the user's loader's line, else the
    # framework's own and the user's that led there ("transformers/trainer.py:1051 (from train.py:61)").
    built: str | None
    dataset: str
    batch_size: int | None  # per batch; from its batch sampler where the DataLoader's own is None
    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    elsewhere: NotRequired[bool]  # iterated in a thread other than the training thread (a prefetcher)
    steps_fed: NotRequired[int]  # added when read (loader_use): steps whose last batch came from it
    passes: NotRequired[int]  # added when read: passes over it (iter() calls) in the training thread
    pass_seconds: NotRequired[float]  # added when read: their seconds, each from iter() to its latest batch


class LoaderUseRecord(TypedDict):
    """Per loader record, in their order (a whole-run tally): the steps whose last batch came from
    it - the batches they trained on -, its passes and their seconds."""
    type: Literal["loader_use"]
    steps_fed: list[int]
    passes: NotRequired[list[int]]
    pass_seconds: NotRequired[list[float]]


class StepRecord(TypedDict):
    """One training step ("step"), or the time after the last one ("tail")."""
    type: Literal["step", "tail"]
    t0: float | None
    t1: float
    excl: dict[str, float]  # exclusive seconds per category (CATEGORIES)
    counts: dict[str, float]  # syncs, copies and their bytes, seconds per transform
    profiled: bool  # inside the kernel window (torch.profiler's own cost: not a normal step)
    data: list[list[float]]  # [t0, t1] of each data wait
    i: NotRequired[int]  # steps only
    spans: NotRequired[list[list]]  # [name, category, t0, t1] of the first trace_steps steps


class LongestStep(TypedDict):
    i: int
    t0: float
    t1: float
    excl: dict[str, float]
    counts: NotRequired[dict[str, float]]


class BlockRecord(TypedDict):
    """Steps after the detailed window, summed (record/blocks.py): steps i0..i1, n of them."""
    type: Literal["block"]
    i0: int
    i1: int
    n: int
    t0: float  # the first step's start
    t1: float  # the last step's end
    excl: dict[str, float]  # seconds per category, summed
    counts: dict[str, float]  # summed
    profiled: int  # steps inside a measurement window
    durations: dict[str, int]  # step-time histogram: bin floor(8 log2(seconds)) -> steps
    longest: LongestStep | None


class CompileRecord(TypedDict):
    """torch.compile did or said something (record/probes/compiled.py). kind "compile": t0..t1,
    trigger (dynamo, lazy_backward, cudagraph_recording), compile_id "frame/attempt" (attempt > 0:
    a recompile); "recompile": reason, the guards that failed; "graph_break", "cudagraph_skip":
    torch's reason; "cudagraph_rerecord": what changed since the recording, for which inputs.
    where: the script's line (the call into compiled code, or the line that broke the graph);
    defined_at: a recompiled function's own line."""
    type: Literal["compile"]
    kind: str
    t0: float
    t1: float
    compile_id: str | None
    trigger: str | None
    function: str | None
    where: str | None
    reason: str | None
    defined_at: str | None


class RuleRecord(TypedDict):
    """The rule ending steps from here on (record/steps.py): "explicit", "optimizer" or "backward";
    written when it changes, so a process that dies still says how its steps were found."""
    type: Literal["rule"]
    rule: str


class CudaUsage(TypedDict):
    """Did the script use CUDA, and which devices (by UUID, to match NVML's GPUs)."""
    available: bool
    initialized: bool
    sync_debug_mode: bool
    devices: list[dict]


class CudaRecord(CudaUsage):
    """The script put work on the GPU: written at the first step end after it did, so a process
    that dies still says so (the end record says it again)."""
    type: Literal["cuda"]


class FoldRecord(TypedDict):
    """The steps before it belong to the first step after it (a stronger step rule took over)."""
    type: Literal["fold"]


class KernelsRecord(TypedDict, total=False):
    """torch.profiler's window over a few steps (CUDA), or the error that kept it from running."""
    type: Literal["kernels"]
    error: str
    steps: int
    kernels_per_step: float
    kernel_median_us: float | None
    kernel_p90_us: float | None
    device_busy_s_per_step: float
    device_busy_s_per_step_by_device: dict[str, float]
    memcpy_s_per_step: float
    memcpy_pageable_per_step: float
    runtime_sync_s_per_step: float


class MemoryRecord(StepMemory, total=False):
    """The memory window's measured step (`step`: its index), or only the `error` that kept it
    from running."""
    type: Literal["memory"]
    error: str
    step: int


class OomRecord(OutOfMemory, total=False):
    """The process ran out of memory: where, what was asked for, what was in use by category."""
    type: Literal["oom"]


class EndRecord(TypedDict):
    type: Literal["end"]
    t: float
    exit_code: int | None
    error: str | None  # the uncaught exception ("RuntimeError: ..."), or "stopped by SIGTERM"
    where: NotRequired[str | None]  # the user's line the exception came from
    steps: NotRequired[int]  # steps done when it ended
    cuda: CudaUsage


def events_file(directory: Path | str, pid: int) -> Path:
    return Path(directory) / f"{EVENTS_PREFIX}{pid}.jsonl"


# crash-<pid>.txt, beside the events file: faulthandler's traceback of a fatal signal (SIGSEGV, SIGABRT, ...),
# all a process that dies without a word leaves behind (the job's alive files are alive/protocol.py's)
CRASH_PREFIX = "crash-"


def crash_file(directory: Path | str, pid: int) -> Path:
    return Path(directory) / f"{CRASH_PREFIX}{pid}.txt"


def iter_events(path: Path) -> Iterator[dict]:
    """The records of an events file, one at a time; a line cut short by a crash is skipped."""
    try:
        f = open(path)
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue


MAX_BLOCKS = 2048  # blocks kept per process: neighbours are merged beyond it
BINS_PER_OCTAVE = 8  # a block's step-time histogram: bin floor(8 log2(seconds)), 9% wide


def merge_blocks(a: dict, b: dict) -> dict:
    """Two consecutive blocks as one."""
    merged = {**a, "i1": b["i1"], "t1": b["t1"], "n": a["n"] + b["n"], "profiled": a["profiled"] + b["profiled"],
              "excl": added(a["excl"], b["excl"]), "counts": added(a["counts"], b["counts"]),
              "durations": added(a["durations"], b["durations"])}
    la, lb = a.get("longest"), b.get("longest")
    merged["longest"] = max((x for x in (la, lb) if x), key=lambda x: x["t1"] - x["t0"], default=None)
    return merged


def added(first: dict, *more: dict) -> dict:
    """The tallies summed key by key (keys in order of first appearance)."""
    out = dict(first)
    for tally in more:
        for k, v in tally.items():
            out[k] = out.get(k, 0) + v
    return out


def read_lanes(directory: Path) -> list["Recording"]:
    """One Recording per process that wrote an events file, in order of start, with its step tally
    and crash report (if any) and the count of ranks recorded on this machine."""
    lanes = []
    for path in Path(directory).glob(f"{EVENTS_PREFIX}*.jsonl"):
        lane = Recording(iter_events(path))
        if lane.pid is not None:
            lane.tally = read_tally(tally_file(directory, lane.pid))
            lane.crash = _read_text(crash_file(directory, lane.pid))
        lanes.append(lane)
    ranks = sum(lane.rank is not None for lane in lanes)
    for lane in lanes:
        lane.ranks_here = ranks
    return sorted(lanes, key=lambda r: (r.process.get("t") or r.start.get("t") or 0.0, r.pid or 0))


def _read_text(path: Path) -> str | None:
    try:
        return Path(path).read_text(errors="replace").strip() or None
    except OSError:
        return None


# A record kind -> the Recording attribute that keeps the last record of it.
_LATEST = {"process": "process", "start": "start", "rank": "rank_record", "end": "end", "cuda": "_cuda_in_use",
           "tail": "tail", "facts": "facts", "kernels": "kernels", "memory": "memory", "oom": "oom",
           "loader_use": "_loader_use"}


class Recording:
    """The records of one process, sorted by kind (the reading side of the format above)."""

    def __init__(self, records: Iterable[dict]):
        self.process: dict = {}
        self.start: dict = {}
        self.rank_record: dict = {}
        self.end: dict | None = None
        self.steps: list[dict] = []
        self.blocks: list[dict] = []  # the steps after the detailed window, in aggregate
        self.tail: dict | None = None
        self.loaders: list[dict] = []
        self.sites: list[dict] = []
        self.hot: dict[str, dict[str, float]] = {}  # category -> user line -> seconds of stack samples
        self.hot_steps: dict[str, dict[str, int]] = {}  # category -> user line -> steps its samples fell in
        self.hot_blocked: dict[str, dict[str, float]] = {}  # category -> user line -> seconds of it blocked
        self.hot_interval_s = 0.0
        self.span_seconds: dict[str, float] = {}
        self.facts: dict = {}
        self.kernels: dict | None = None
        self.memory: dict | None = None
        self.oom: dict | None = None
        self._cuda_in_use: dict | None = None
        self._loader_use: dict = {}
        self._rule: str | None = None
        self.compiles: list[dict] = []  # torch.compile's records, in order
        self.tally: tuple[int, float] | None = None  # (steps, t of the last) from tally-<pid>.bin
        self.crash: str | None = None  # faulthandler's report of a fatal signal
        self.ranks_here: int | None = None  # ranks recorded on this machine (read_lanes counts them)
        # (share of "other", lines) of torch operators outside modules: analyze/step_costs.py's
        # operators_as_compute, once, as it moves those lines' stack samples to compute
        self.operators: tuple[float, list[str]] | None = None
        folded: list[dict] = []
        for r in records:
            kind = r.get("type")
            if kind in _LATEST:
                setattr(self, _LATEST[kind], r)
            elif kind == "rule":
                self._rule = r["rule"]
            elif kind == "compile":
                self.compiles.append(r)
            elif kind == "fold":  # the steps so far belong to the next one (record/steps.py: step rules)
                folded, self.steps = folded + self.steps, []
            elif kind == "step":
                self.steps.append(_merged(folded, r) if folded else r)
                folded = []
            elif kind == "block":
                self._add_block(r)
            elif kind == "loader":
                self.loaders.append(r)
            elif kind == "sites":  # snapshots: the last one is the whole run
                self.sites = r["sites"]
            elif kind == "hot":
                self.hot, self.hot_steps, self.hot_interval_s = r["lines"], r["steps"], r["interval_s"]
                self.hot_blocked = r.get("blocked", {})
            elif kind == "spans":
                self.span_seconds = r["seconds"]
        for key in ("steps_fed", "passes", "pass_seconds"):
            for loader, n in zip(self.loaders, self._loader_use.get(key, [])):
                loader[key] = n

    def _add_block(self, block: dict) -> None:
        self.blocks.append(block)
        if len(self.blocks) > MAX_BLOCKS:  # half as many, each twice as long
            pairs = zip(self.blocks[0::2], self.blocks[1::2])
            self.blocks = [merge_blocks(a, b) for a, b in pairs] + self.blocks[len(self.blocks) // 2 * 2:]

    @property
    def t_start(self) -> float | None:
        return self.start.get("t")

    @property
    def pid(self) -> int | None:
        return self.process.get("pid") or self.start.get("pid")

    @property
    def rank(self) -> int | None:
        """The default process group's rank, else RANK in the environment at start (torchrun's)."""
        rank = self.rank_record.get("rank")
        return rank if rank is not None else self.start.get("rank")

    @property
    def local_world_size(self) -> int | None:
        """The ranks sharing this machine's cores: LOCAL_WORLD_SIZE (torchrun's), else the ranks
        recorded here (Lightning and mp.spawn set no such variable)."""
        return self.start.get("local_world_size") or (self.ranks_here if self.rank is not None else None)

    @property
    def fed_loader(self) -> dict | None:
        """The DataLoader whose batches most steps trained on (not the first iterated: Lightning
        iterates the validation loader first); the first one when none fed a step."""
        return max(self.loaders, key=lambda loader: loader.get("steps_fed", 0), default=None)

    @property
    def recorded(self) -> bool:
        """Did the recorder run in this process (it imported torch)?"""
        return bool(self.start)

    @property
    def trained(self) -> bool:
        return self.steps_done > 0

    @property
    def steps_done(self) -> int:
        """Steps finished: the durable tally's count where the events file lost the last ones (SIGKILL)."""
        recorded = len(self.steps) + sum(b["n"] for b in self.blocks)
        return max(recorded, self.tally[0] if self.tally else 0)

    @property
    def step_rule(self) -> str | None:
        """How steps were found ("optimizer", "backward", "explicit"): from the rule records, which
        a process that dies leaves in full, else the facts (a snapshot)."""
        return self._rule or self.facts.get("step_rule")

    @property
    def cuda(self) -> CudaUsage | None:
        """How the script used CUDA: the end record's account, else the cuda record (a process that
        died); None: not known."""
        return (self.end or {}).get("cuda") or self._cuda_in_use

    @property
    def is_dataloader_worker(self) -> bool:
        return bool(self.facts.get("dataloader_worker"))


def _merged(earlier: list[dict], step: dict) -> dict:
    """One step made of `earlier` steps and `step`: times, counts and spans added up."""
    merged = {**step, "t0": earlier[0]["t0"], "excl": dict(step["excl"]), "counts": dict(step["counts"]),
              "data": [span for r in earlier for span in r.get("data", [])] + step.get("data", [])}
    if "spans" in step:
        merged["spans"] = [span for r in earlier for span in r.get("spans", [])] + step["spans"]
    for r in earlier:
        merged["excl"], merged["counts"] = added(merged["excl"], r["excl"]), added(merged["counts"], r["counts"])
    return merged


def by_rank(lanes: list[Recording]) -> list[Recording]:
    """Ranks first, in rank order; other processes after them, in the order given."""
    return sorted(lanes, key=lambda r: (r.rank is None, r.rank or 0))


def trainers(lanes: list[Recording]) -> list[Recording]:
    """The processes that ran training steps (DataLoader workers never do), ranks in rank order."""
    return by_rank([r for r in lanes if r.trained and not r.is_dataloader_worker])


def diagnosed_lane(lanes: list[Recording], main_pid: int) -> Recording | None:
    """The process a job's report is about: the script's own process when it trained, else rank 0
    of a torchrun job, else the child that trained most (hogwild-style trainers), else the script."""
    main = next((r for r in lanes if r.pid == main_pid), None)
    trained = trainers(lanes)
    if main is not None and main.trained:
        return main
    if trained and trained[0].rank is not None:
        return trained[0]
    return max(trained, key=lambda r: len(r.steps), default=main)
