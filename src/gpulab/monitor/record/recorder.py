"""Recording what a training loop does, from outside the user's code.

While a session records, the hooks and patches of gpulab.monitor.patches call the recorder, and
it puts every moment of the training thread into one of six categories:

    data_wait  blocked in a DataLoader (creating its iterator, or fetching the next batch) -
               everything that runs inside the fetch: Dataset.__getitem__, transforms (also
               those that are nn.Modules, like torchvision's), collate
    h2d        copying a batch host -> device (CUDA), or the trainer's scatter to its devices
    compute    inside a module's forward, autograd's backward, an optimizer's step or zero_grad
    collective inside a torch.distributed call (all_reduce, broadcast, barrier, ...) or waiting
               for an asynchronous one (Work.wait), and gpulab's own wait for its gradient
               buckets; DDP waits for its buckets inside backward, in C++: that time is moved
               from compute to collective with DDP's own timers (diagnose.py)
    sync       blocked in a host sync on CUDA (`.item()`, `print(t)`, `.cpu()`, synchronize, ...)
    other      anything else: the user's Python between those calls (and torch ops called
               outside any nn.Module, e.g. a functional loss or a manual SGD update)

Steps, by the first rule that applies (the report says which):
    explicit   `p.step()` calls (the Python API)
    optimizer  a torch.optim optimizer's step() (the first optimizer that steps, for a GAN)
    backward   otherwise each top-level backward() (or autograd.grad): the step ends when the
               loop comes back for the next batch or the next forward, so a manual update
               (`p.data.add_(...)`) after backward belongs to its step
Steps ended by a weaker rule before a stronger one shows up (gradient accumulation before the
first optimizer.step()) are folded into the first step of the stronger rule.

Accounting is exclusive: a sync inside a forward counts as sync, not compute, because time is
charged, at each transition, to whatever is on top of the span stack.

Only the thread that started the recorder is recorded (other threads' calls pass straight
through). A process forked from a recorded one is its own lane (its own events file) - unless it
is a DataLoader worker being started, which records nothing.

Records are plain dicts (format: events.py); with `events_path` they are appended to a
JSON-lines file about once a second, so a process that crashes still leaves most of its record.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch

from gpulab.monitor import patches
from gpulab.monitor.attach import block_signals_in_this_thread
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.cuda_hooks import CudaHooks
from gpulab.monitor.events import (CATEGORIES, TRANSFORM_PREFIX, EndRecord, FoldRecord, LoaderRecord, ProcessRecord,
                                   StartRecord, StepRecord)
from gpulab.monitor.frames import user_site


_FLUSH_EVERY_S = 1.0
_DDP_READ_EVERY_S = 0.2
# The stack sampler needs the GIL to look at the training thread. A thread running pure Python
# only hands the GIL over every `sys.getswitchinterval()` (5 ms by default), so samples would
# land on the next torch call instead of inside the Python loop that holds the GIL; a 1 ms
# interval keeps that bias well under the 20 ms sampling period.
_SWITCH_INTERVAL_S = 0.001
_MAX_DATA_SPANS_PER_STEP = 64


class Recorder:
    def __init__(self, cfg: ProfileConfig, events_path: Path | None = None):
        self.cfg = cfg
        self.events_path = Path(events_path) if events_path else None
        self.records: list[dict] = []  # all records (in memory), or those not yet flushed (to a file)
        self.cuda = CudaHooks(self, window_after_step=cfg.warmup_steps, window_steps=cfg.kernel_window_steps)
        self.error: str | None = None  # an uncaught exception, noted by attach.py's excepthook
        self._ident: int | None = None
        self._detached = False
        self._stopping = False
        self._patches: patches.Patches | None = None  # in place while recording
        self._transform_sites: dict[int, str] = {}  # id(transform) -> where the user built it
        self._ddp_modules: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._ddp_stats: dict | None = None
        self._ddp_read_at = float("-inf")
        self._reset_run_state()

    def _reset_run_state(self) -> None:
        """Everything one process records (a forked lane starts again from here)."""
        self._pid = os.getpid()
        # the span stack and the charge clock
        self._stack: list[tuple[str, str, float]] = []
        self._t_last: float | None = None
        # the current step
        self._step_index = 0
        self._step_t0: float | None = None
        self._new_step_state(profiled=False)
        self._step_rule: str | None = None  # "explicit", "optimizer" or "backward"
        self._backward_since_step = 0
        # whole-run facts
        self.sync_sites: dict[str, dict] = {}
        self.span_seconds: Counter = Counter()
        self.transforms: dict[str, dict] = {}  # "Normalize" -> {calls, where}
        self._transform_depth = 0
        self.hot: dict[str, Counter] = defaultdict(Counter)
        self._hot_lock = threading.Lock()
        self._loaders: set[int] = set()
        self._primary_optimizer = None  # weakref to the optimizer whose step ends a training step
        self._optimizer_tokens: dict[int, int] = {}
        self._counts_total = Counter({"backward": 0, "optimizer_step": 0})
        self.in_forward = False  # inside the outermost module call (patches.py)
        self.in_backward = False
        self._last_flush = time.perf_counter()
        self._stop_sampling = threading.Event()
        self._stack_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ session

    def start(self, command: list[str] | None = None) -> "Recorder":
        self._patches = patches.install(self)  # refuses a second recorder in this process
        self._ident = threading.get_ident()
        self._emit_start(command if command is not None else list(sys.argv))
        if self.cfg.stack_interval_s > 0:
            previous_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(previous_interval, _SWITCH_INTERVAL_S))
            self._patches.on_undo(lambda: sys.setswitchinterval(previous_interval))
            self._start_stack_sampler()
        return self

    def _emit_start(self, command: list[str]) -> None:
        record: StartRecord = {
            "type": "start",
            "t": time.perf_counter(),
            "pid": self._pid,
            "ppid": os.getppid(),
            "rank": _env_int("RANK"),
            "local_world_size": _env_int("LOCAL_WORLD_SIZE"),  # ranks sharing this machine's cores
            "world_size": _env_int("WORLD_SIZE"),
            "command": command,
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_cuda_build": torch.version.cuda,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "config": self.cfg.to_dict(),
        }
        self._emit(record)

    def _start_stack_sampler(self) -> None:
        self._stack_thread = threading.Thread(target=self._sample_stacks, name="gpulab-stacks", daemon=True)
        self._stack_thread.start()

    def become_forked_lane(self) -> None:
        """In a child forked from a recorded process (multiprocessing's fork/forkserver, os.fork):
        record this process from here on, in its own events file."""
        directory = self.events_path.parent
        self._reset_run_state()
        self.records = []
        self.events_path = directory / f"events-{self._pid}.jsonl"
        self._ident = threading.get_ident()  # the forking thread is the child's only thread
        process: ProcessRecord = {"type": "process", "pid": self._pid, "ppid": os.getppid(), "t": time.perf_counter(),
                                  "argv": list(getattr(sys, "orig_argv", sys.argv)), "forked": True, "error": None}
        self._emit(process)
        self._emit_start(list(getattr(sys, "orig_argv", sys.argv)))
        if self.cfg.stack_interval_s > 0:
            self._start_stack_sampler()

    def detach(self) -> None:
        """In a DataLoader worker: record nothing, write nothing, leave the parent's patches inert."""
        self._ident = None
        self._detached = True

    def stop_in_any_process(self, exit_code: int | None = None, error: str | None = None) -> None:
        """stop(), if this process's recording is still running (atexit, signals, multiprocessing
        children: whichever comes first)."""
        if self.recording() and not self._detached and self._pid == os.getpid():
            self.stop(exit_code=exit_code, error=error)

    def stop(self, exit_code: int | None = None, error: str | None = None) -> None:
        """End the session: close the open step as the run's tail, restore torch, flush."""
        if not self.recording():
            return
        # A signal can arrive while stopping (SIGTERM during the atexit flush): stop only once.
        self._stopping = True
        if self._ident is not None:
            self.end_step_after_backward()  # the last step of the backward rule ends with the run
        now = time.perf_counter()
        if self._t_last is not None and self._ident is not None:
            self._charge(now)
            tail: StepRecord = {"type": "tail", "t0": self._step_t0, "t1": now, **self._step_fields()}
            self._emit(tail)
        self._stop_sampling.set()
        if self._stack_thread is not None:
            self._stack_thread.join(timeout=1.0)  # never hang an exiting process on the profiler
        with self.cuda.suppressed():
            self.cuda.finish(self._step_index)
        self._patches.undo()
        end: EndRecord = {"type": "end", "t": now, "exit_code": exit_code, "error": error or self.error,
                          "cuda": self.cuda.usage()}
        self._emit(end)
        self.flush(final=True)
        self._ident = None
        self._patches = None

    def recording(self) -> bool:
        """Started, and not stopped (nor stopping)."""
        return self._patches is not None and not self._stopping

    def after_fork_in_child(self) -> None:
        """In a forked child (patches._follow_forks): a DataLoader worker or a child of an
        in-process session records nothing; any other child becomes its own lane."""
        if self.events_path is None or self.loading_data():
            self.detach()
        else:
            self.become_forked_lane()

    def here(self) -> bool:
        """Is the caller the recorded (training) thread?"""
        return threading.get_ident() == self._ident

    def loading_data(self) -> bool:
        """Is the recorded thread inside a DataLoader fetch right now?"""
        stack = self._stack
        return bool(stack) and stack[-1][1] == "data_wait"

    # ------------------------------------------------------------------ spans and steps

    def enter(self, name: str, category: str) -> int:
        now = time.perf_counter()
        if self._t_last is None:
            self._begin(now)
        else:
            self._charge(now)
        self._stack.append((name, category, now))
        return len(self._stack) - 1

    def exit(self, token: int) -> None:
        """Close the span `token` (and any span left open above it, e.g. by an exception)."""
        now = time.perf_counter()
        self._charge(now)
        while len(self._stack) > token:
            name, category, t0 = self._stack.pop()
            self._close_span(name, category, t0, now)

    @contextmanager
    def span(self, name: str, category: str):
        if not self.here():
            yield
            return
        token = self.enter(name, category)
        try:
            yield
        finally:
            self.exit(token)

    def add_closed_span(self, name: str, category: str, t0: float, t1: float) -> None:
        """Charge [t0, t1] to `category`: for calls classified only after they returned (a sync)."""
        if self._t_last is None:
            self._begin(t0)
        t0 = max(t0, self._t_last)
        self._charge(t0)
        self._acc[category] += t1 - t0
        self._t_last = t1
        self._close_span(name, category, t0, t1)

    def mark_step(self) -> None:
        """An explicit step boundary (`p.step()`); from then on nothing else marks steps."""
        if not self.here():
            return
        self._use_step_rule("explicit")
        self.end_step()

    _RULE_STRENGTH = {None: 0, "backward": 1, "optimizer": 2, "explicit": 3}

    def _use_step_rule(self, rule: str) -> bool:
        """Switch to `rule` if it is stronger than the current one; False if a stronger one rules."""
        current = self._step_rule
        if self._RULE_STRENGTH[rule] < self._RULE_STRENGTH[current]:
            return False
        if rule != current:
            if self._step_index > 0:
                # Steps ended by the weaker rule belong to the first step of this one; the reader
                # (events.Recording) merges them, since some may already be in the file.
                fold: FoldRecord = {"type": "fold"}
                self._emit(fold)
                self._step_index = 0
            self._step_rule = rule
        return True

    def end_step_after_backward(self) -> None:
        """Backward rule: the loop came back for data or a forward after a backward: a step ended."""
        if self._backward_since_step and self._step_rule in (None, "backward"):
            self._use_step_rule("backward")
            self.end_step()

    def end_step(self) -> None:
        now = time.perf_counter()
        if self._t_last is None:
            self._begin(now)
        self._charge(now)
        self._backward_since_step = 0
        record: StepRecord = {"type": "step", "i": self._step_index, "t0": self._step_t0, "t1": now, **self._step_fields()}
        if self._step_index < self.cfg.trace_steps:
            record["spans"] = self._spans
        self._emit(record)
        self._step_index += 1
        if self._ddp_modules:
            self.ddp_runtime_stats()
        if self.cuda.enabled:
            with self.cuda.suppressed():  # our own bookkeeping (kernel window) is no sync of the user's
                self.cuda.on_step_end(self._step_index)
        if self.cfg.stop_after_steps and self._step_index >= self.cfg.stop_after_steps:
            self._end_process_early()
        if now - self._last_flush > _FLUSH_EVERY_S:
            self.flush()
        # Time spent here, in the profiler's own bookkeeping, belongs to neither step.
        resume = time.perf_counter()
        self._new_step_state(profiled=self.cuda.window_active)
        self._step_t0 = self._t_last = resume

    def _begin(self, now: float) -> None:
        self._t_last = self._step_t0 = now

    def _charge(self, now: float) -> None:
        if self._stack:
            name, category, _ = self._stack[-1]
            if category == "data_wait" and name.startswith(TRANSFORM_PREFIX):
                self._counts[name] += now - self._t_last  # "transform: Normalize": seconds this step
        else:
            category = "other"
        self._acc[category] += now - self._t_last
        self._t_last = now

    def _close_span(self, name: str, category: str, t0: float, t1: float) -> None:
        self.span_seconds[name] += t1 - t0
        if self._step_index < self.cfg.trace_steps:
            self._spans.append([name, category, t0, t1])
        if category == "data_wait" and not self._transform_depth and len(self._data_spans) < _MAX_DATA_SPANS_PER_STEP:
            self._data_spans.append([t0, t1])

    def _new_step_state(self, profiled: bool) -> None:
        self._acc = dict.fromkeys(CATEGORIES, 0.0)
        self._spans: list[list] = []
        self._data_spans: list[list] = []
        self._counts = Counter()
        self._profiled = profiled

    def _step_fields(self) -> dict:
        return {
            "excl": self._acc,
            "counts": dict(self._counts),
            "profiled": self._profiled,
            "data": self._data_spans,
        }

    # ------------------------------------------------------------------ syncs and copies (from cuda_hooks)

    def add_sync(self, op: str, t0: float, t1: float, where: str | None) -> None:
        self.add_closed_span(f"sync: {op}", "sync", t0, t1)
        self._counts["sync"] += 1
        self._site("sync", op, where, seconds=t1 - t0)

    def add_untimed_sync(self, where: str | None) -> None:
        """A sync torch reported (sync debug mode) inside a call gpulab does not time (e.g. x[mask])."""
        self._counts["sync_untimed"] += 1
        self._site("sync", "untimed", where, untimed=1)

    def add_h2d(self, op: str, t0: float, t1: float, nbytes: int, pinned: bool, blocking: bool,
                where: str | None) -> None:
        """A host-to-device copy. Kinds: h2d_pageable (staged through a driver buffer),
        h2d_pinned_blocking (pinned, but the host waited: no non_blocking=True), h2d_pinned (async)."""
        kind = "h2d_pageable" if not pinned else "h2d_pinned_blocking" if blocking else "h2d_pinned"
        label = "pageable" if not pinned else "pinned, blocking" if blocking else "pinned"
        self.add_closed_span(f"copy: {op} ({label})", "h2d", t0, t1)
        self._counts[kind] += 1
        self._counts[kind + "_bytes"] += nbytes
        self._site(kind, op, where, seconds=t1 - t0, nbytes=nbytes)

    def _site(self, kind: str, op: str, where: str | None, seconds: float = 0.0, untimed: int = 0, nbytes: int = 0):
        key = f"{kind}|{where}"
        site = self.sync_sites.get(key)
        if site is None:
            site = self.sync_sites[key] = {"kind": kind, "where": where, "ops": [], "count": 0,
                                           "seconds": 0.0, "untimed": 0, "bytes": 0}
        if op not in site["ops"]:
            site["ops"].append(op)
        site["count"] += 1
        site["seconds"] += seconds
        site["untimed"] += untimed
        site["bytes"] += nbytes

    # ------------------------------------------------------------------ where the time goes, by line

    def _sample_stacks(self) -> None:
        """Every few ms, note the innermost user line the training thread is on, per category."""
        interval = self.cfg.stack_interval_s
        block_signals_in_this_thread()
        while not self._stop_sampling.wait(interval):
            ident = self._ident
            frame = sys._current_frames().get(ident) if ident is not None else None
            if frame is None or self._t_last is None:
                continue
            try:
                stack = self._stack
                category = stack[-1][1] if stack else "other"
            except IndexError:  # the stack changed under us; skip this sample
                continue
            where = user_site(frame)
            del frame
            if where is not None:
                with self._hot_lock:
                    self.hot[category][where] += 1

    # ------------------------------------------------------------------ output

    def _emit(self, record: dict) -> None:
        self.records.append(record)

    def _snapshots(self) -> list[dict]:
        with self._hot_lock:
            hot = {c: dict(counter.most_common(20)) for c, counter in self.hot.items()}
        return [
            {"type": "sites", "sites": list(self.sync_sites.values())},
            {"type": "hot", "interval_s": self.cfg.stack_interval_s, "lines": hot},
            {"type": "spans", "seconds": {k: round(v, 6) for k, v in self.span_seconds.items()}},
            {"type": "facts", "step_rule": self._step_rule, "backward_calls": self._counts_total["backward"],
             "optimizer_steps": self._counts_total["optimizer_step"], "dataloader_worker": _in_dataloader_worker(),
             "torch_threads": torch.get_num_threads(),
             "transforms": self.transforms, "ddp": self.ddp_runtime_stats()},
        ]

    def flush(self, final: bool = False) -> None:
        """Append pending records to the events file (whole-run tallies as snapshots: last one wins)."""
        self._last_flush = time.perf_counter()
        if self.events_path is None:
            if final:
                self.records.extend(self._snapshots())
            return
        if os.getpid() != self._pid or self._detached:
            return
        lines = [json.dumps(r) for r in [*self.records, *self._snapshots()]]
        with open(self.events_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        self.records.clear()

    # ------------------------------------------------------------------ hooks

    def ddp_runtime_stats(self) -> dict | None:
        """DDP's own timers for its backward (it samples some iterations): how long its bucket
        allreduces ran and how much of that overlapped the backward computation. The rest, the
        exposed part, is time backward spent waiting for communication. Read while the DDP module
        lives (at step ends, at most every _DDP_READ_EVERY_S) and kept: a script's DDP is often
        gone by the time the recorder stops."""
        ddp = next(iter(self._ddp_modules), None)
        if ddp is None or time.perf_counter() - self._ddp_read_at < _DDP_READ_EVERY_S:
            return self._ddp_stats
        self._ddp_read_at = time.perf_counter()
        try:
            data = ddp._get_ddp_logging_data()
        except Exception:  # a private API: gone or changed in this torch
            return None
        comm_ns = data.get("avg_backward_comm_time") or 0
        if comm_ns <= 0:
            return self._ddp_stats  # no iteration sampled yet
        overlap_ns = data.get("avg_backward_compute_comm_overlap_time") or 0
        self._ddp_stats = {"avg_backward_comm_s": comm_ns / 1e9, "avg_overlap_s": overlap_ns / 1e9,
                "exposed_comm_s": max(comm_ns - overlap_ns, 0) / 1e9,
                "avg_backward_compute_s": (data.get("avg_backward_compute_time") or 0) / 1e9,
                "bucket_cap_bytes": data.get("bucket_cap_bytes"), "backend": data.get("backend_name")}
        return self._ddp_stats

    def note_module(self, module: torch.nn.Module) -> None:
        """A top-level module call: DDP's own timers are read from the DDP module (ddp_runtime_stats)."""
        if torch.distributed.is_available():
            from torch.nn.parallel import DistributedDataParallel

            if isinstance(module, DistributedDataParallel):
                self._ddp_modules.add(module)

    def backward_done(self) -> None:
        self._backward_since_step += 1
        self._counts_total["backward"] += 1

    def on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.here():
            self._optimizer_tokens[id(optimizer)] = self.enter(f"{type(optimizer).__name__}.step", "compute")

    def on_optimizer_post(self, optimizer, args, kwargs) -> None:
        if not self.here():
            return
        token = self._optimizer_tokens.pop(id(optimizer), None)
        if token is not None:
            self.exit(token)
        self._counts_total["optimizer_step"] += 1
        if not self._use_step_rule("optimizer"):
            return
        # With several optimizers (a GAN, gpulab's per-replica optimizers) the first one to step
        # marks the training step; if it is garbage-collected, the next one takes over.
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            primary = optimizer
        if optimizer is primary:
            self.end_step()

    # ------------------------------------------------------------------ transforms (data time)

    _TRANSFORM_DEPTH = 2  # a Compose and its members; deeper calls are part of their transform

    def begin_transform(self, transform) -> int | None:
        """A transform inside a fetch starts: its own data_wait span, to rank transforms by cost
        (None: nested too deep, part of its parent's span)."""
        if self._transform_depth >= self._TRANSFORM_DEPTH:
            return None
        name = type(transform).__name__
        entry = self.transforms.get(name)
        if entry is None:
            where = self._transform_sites.get(id(transform)) or user_site(sys._getframe(1))
            entry = self.transforms[name] = {"calls": 0, "where": where}
        entry["calls"] += 1
        self._transform_depth += 1
        return self.enter(TRANSFORM_PREFIX + name, "data_wait")

    def end_transform(self, token: int) -> None:
        self.exit(token)
        self._transform_depth -= 1

    def call_transform(self, transform, call, *args, **kwargs):
        """call(*args, **kwargs) as the transform span of `transform` (one that is no nn.Module)."""
        token = self.begin_transform(transform)
        if token is None:
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        finally:
            self.end_transform(token)

    def note_transforms(self, transforms, where: str | None) -> None:
        """Where the user built these transforms (a Compose of them)."""
        for t in transforms:
            self._transform_sites.setdefault(id(t), where)

    # ------------------------------------------------------------------ `gpulab profile --try`

    def _end_process_early(self) -> None:
        """`--try` measures the first K steps: write the record and leave at once (whatever the
        script would do next is not measured; gpulab stops what the process leaves behind)."""
        self.stop(exit_code=0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def note_loader(self, loader, caller) -> None:
        if id(loader) in self._loaders:
            return
        self._loaders.add(id(loader))
        record: LoaderRecord = {
            "type": "loader",
            "where": user_site(caller),
            "dataset": type(loader.dataset).__name__,
            "batch_size": loader.batch_size,
            "num_workers": loader.num_workers,
            "pin_memory": bool(loader.pin_memory),
            "persistent_workers": bool(loader.persistent_workers),
        }
        self._emit(record)


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None


def _in_dataloader_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None
