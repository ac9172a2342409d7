"""Recording what a training loop does, from outside the user's code.

The recorder patches a handful of PyTorch entry points for the duration of a session and puts
every moment of the training thread into one of five categories:

    data_wait  blocked in a DataLoader (creating its iterator, or waiting for the next batch)
    h2d        copying a batch host -> device (CUDA), or the trainer's scatter to its devices
    compute    inside a module's forward, autograd's backward, an optimizer's step or zero_grad
    sync       blocked in a host sync on CUDA (`.item()`, `print(t)`, `.cpu()`, synchronize, ...)
    other      anything else: the user's Python between those calls (and torch ops called
               outside any nn.Module, e.g. a functional loss)

Step boundaries come from optimizer step hooks (torch.optim's global post-hook), or from explicit
`mark_step()` calls. Accounting is exclusive: a sync inside a forward counts as sync, not compute,
because time is charged, at each transition, to whatever is on top of the span stack.

Only the thread that started the recorder is recorded (other threads' calls pass straight
through), and a forked child (a DataLoader worker) forgets the recorder at once.

Records are plain dicts (one per step, plus a few facts); with `events_path` they are appended to
a JSON-lines file about once a second, so a script that crashes still leaves most of its record.
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
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpulab.errors import UserError
from gpulab.monitor import phases
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.cuda_hooks import CudaHooks
from gpulab.monitor.frames import user_site

CATEGORIES = ("data_wait", "h2d", "compute", "sync", "other")

# gpulab's own trainer reports its phases through PhaseTimer; this is where each one belongs.
PHASE_CATEGORY = {
    "data": "data_wait",
    "scatter": "h2d",
    "forward_backward": "compute",
    "allreduce": "compute",
    "optimizer": "compute",
}

_FLUSH_EVERY_S = 1.0
# The stack sampler needs the GIL to look at the training thread. A thread running pure Python
# only hands the GIL over every `sys.getswitchinterval()` (5 ms by default), so samples would
# land on the next torch call instead of inside the Python loop that holds the GIL; a 1 ms
# interval keeps that bias well under the 20 ms sampling period.
_SWITCH_INTERVAL_S = 0.001
_MAX_DATA_SPANS_PER_STEP = 64

_active: "Recorder | None" = None


def _forget_in_forked_child() -> None:
    # A DataLoader worker forked from the training process inherits the patched functions; it
    # must record nothing and never write to the parent's events file.
    if _active is not None:
        _active._ident = None


if hasattr(os, "register_at_fork"):  # POSIX; without fork there is nothing to forget
    os.register_at_fork(after_in_child=_forget_in_forked_child)


class Recorder:
    def __init__(self, cfg: ProfileConfig, events_path: Path | None = None):
        self.cfg = cfg
        self.events_path = Path(events_path) if events_path else None
        self.records: list[dict] = []  # all records (in memory), or those not yet flushed (to a file)
        self.cuda = CudaHooks(self, window_after_step=cfg.warmup_steps, window_steps=cfg.kernel_window_steps)
        self._ident: int | None = None
        self._pid = os.getpid()
        self._undo: list = []
        # the span stack and the charge clock
        self._stack: list[tuple[str, str, float]] = []
        self._t_last: float | None = None
        # the current step
        self._step_index = 0
        self._step_t0: float | None = None
        self._new_step_state(profiled=False)
        # whole-run facts
        self.sync_sites: dict[str, dict] = {}
        self.span_seconds: Counter = Counter()
        self.hot: dict[str, Counter] = defaultdict(Counter)
        self._hot_lock = threading.Lock()
        self._loaders: set[int] = set()
        self._primary_optimizer = None  # weakref to the optimizer whose step ends a training step
        self._explicit_steps = False
        self._optimizer_tokens: dict[int, int] = {}
        self._in_forward = False
        self._in_backward = False
        self._last_flush = time.perf_counter()
        self._stop_sampling = threading.Event()
        self._stack_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ session

    def start(self, command: list[str] | None = None) -> "Recorder":
        global _active
        if _active is not None:
            raise UserError("a gpulab profile is already running in this process: end it before starting another")
        _active = self
        self._ident = threading.get_ident()
        self._emit({
            "type": "start",
            "t": time.perf_counter(),
            "pid": self._pid,
            "command": command if command is not None else list(sys.argv),
            "python": sys.version.split()[0],
            "torch": torch.__version__,
            "torch_cuda_build": torch.version.cuda,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "config": self.cfg.to_dict(),
        })
        self._install()
        if self.cfg.stack_interval_s > 0:
            previous_interval = sys.getswitchinterval()
            sys.setswitchinterval(min(previous_interval, _SWITCH_INTERVAL_S))
            self._undo.append(lambda: sys.setswitchinterval(previous_interval))
            self._stack_thread = threading.Thread(target=self._sample_stacks, name="gpulab-stacks", daemon=True)
            self._stack_thread.start()
        return self

    def stop(self, exit_code: int | None = None, error: str | None = None) -> None:
        """End the session: close the open step as the run's tail, restore torch, flush."""
        global _active
        if _active is not self:
            return
        now = time.perf_counter()
        if self._t_last is not None and self._ident is not None:
            self._charge(now)
            self._emit({"type": "tail", "t0": self._step_t0, "t1": now, **self._step_fields()})
        self._stop_sampling.set()
        if self._stack_thread is not None:
            self._stack_thread.join()
        with self.cuda.suppressed():
            self.cuda.finish(self._step_index)
        self._uninstall()
        self._emit({"type": "end", "t": now, "exit_code": exit_code, "error": error, "cuda": self.cuda.usage()})
        self.flush(final=True)
        self._ident = None
        _active = None

    def here(self) -> bool:
        """Is the caller the recorded (training) thread?"""
        return threading.get_ident() == self._ident

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
        """An explicit step boundary (`p.step()`); from then on optimizer steps no longer mark steps."""
        if not self.here():
            return
        if not self._explicit_steps:
            self._explicit_steps = True
            self._fold_hook_steps()
        self.end_step()

    def _fold_hook_steps(self) -> None:
        """Steps that optimizer hooks ended before the first p.step() belong to that first explicit step."""
        earlier = [r for r in self.records if r["type"] == "step"]
        if not earlier:
            return
        self.records = [r for r in self.records if r["type"] != "step"]
        self._step_index = 0
        self._step_t0 = earlier[0]["t0"]
        for r in earlier:
            for category, seconds in r["excl"].items():
                self._acc[category] += seconds
            self._counts.update(r["counts"])
        self._spans = [span for r in earlier for span in r.get("spans", [])] + self._spans
        self._data_spans = [span for r in earlier for span in r["data"]] + self._data_spans

    def end_step(self) -> None:
        now = time.perf_counter()
        if self._t_last is None:
            self._begin(now)
        self._charge(now)
        record = {"type": "step", "i": self._step_index, "t0": self._step_t0, "t1": now, **self._step_fields()}
        if self._step_index < self.cfg.trace_steps:
            record["spans"] = self._spans
        self._emit(record)
        self._step_index += 1
        if self.cuda.enabled:
            with self.cuda.suppressed():  # our own bookkeeping (kernel window) is no sync of the user's
                self.cuda.on_step_end(self._step_index)
        if now - self._last_flush > _FLUSH_EVERY_S:
            self.flush()
        # Time spent here, in the profiler's own bookkeeping, belongs to neither step.
        resume = time.perf_counter()
        self._new_step_state(profiled=self.cuda.window_active)
        self._step_t0 = self._t_last = resume

    def _begin(self, now: float) -> None:
        self._t_last = self._step_t0 = now

    def _charge(self, now: float) -> None:
        category = self._stack[-1][1] if self._stack else "other"
        self._acc[category] += now - self._t_last
        self._t_last = now

    def _close_span(self, name: str, category: str, t0: float, t1: float) -> None:
        self.span_seconds[name] += t1 - t0
        if self._step_index < self.cfg.trace_steps:
            self._spans.append([name, category, t0, t1])
        if category == "data_wait" and len(self._data_spans) < _MAX_DATA_SPANS_PER_STEP:
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

    def add_h2d(self, op: str, t0: float, t1: float, nbytes: int, pinned: bool, where: str | None) -> None:
        kind = "h2d_pinned" if pinned else "h2d_pageable"
        self.add_closed_span(f"copy: {op} ({'pinned' if pinned else 'pageable'})", "h2d", t0, t1)
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
        ]

    def flush(self, final: bool = False) -> None:
        """Append pending records to the events file (whole-run tallies as snapshots: last one wins)."""
        self._last_flush = time.perf_counter()
        if self.events_path is None:
            if final:
                self.records.extend(self._snapshots())
            return
        if os.getpid() != self._pid:
            return
        lines = [json.dumps(r) for r in [*self.records, *self._snapshots()]]
        with open(self.events_path, "a") as f:
            f.write("\n".join(lines) + "\n")
        self.records.clear()

    # ------------------------------------------------------------------ hooks

    def _install(self) -> None:
        self._patch(DataLoader, "__iter__", self._wrap_loader_iter)
        self._patch(_BaseDataLoaderIter, "__next__", self._wrap_loader_next)
        self._patch(torch.nn.Module, "__call__", self._wrap_module_call)
        self._patch(torch.autograd, "backward", lambda orig: self._wrap_autograd(orig, "backward"))
        self._patch(torch.autograd, "grad", lambda orig: self._wrap_autograd(orig, "autograd.grad"))
        self._patch(torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        pre = register_optimizer_step_pre_hook(self._on_optimizer_pre)
        post = register_optimizer_step_post_hook(self._on_optimizer_post)
        self._undo += [pre.remove, post.remove]
        previous_hook = phases.span_hook
        phases.span_hook = self._phase_span

        def restore_phase_hook():
            phases.span_hook = previous_hook

        self._undo.append(restore_phase_hook)
        self.cuda.install(self._patch)

    def _uninstall(self) -> None:
        self.cuda.uninstall()
        while self._undo:
            self._undo.pop()()

    def _patch(self, owner, name: str, make_wrapper) -> None:
        """Replace owner.name by make_wrapper(original) until the session ends."""
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make_wrapper(original))

        def undo():
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

        self._undo.append(undo)

    def _wrap_loader_iter(self, original):
        rec = self

        def __iter__(loader):
            if not rec.here():
                return original(loader)
            rec._note_loader(loader, sys._getframe(1))
            token = rec.enter("DataLoader.__iter__", "data_wait")
            try:
                return original(loader)
            finally:
                rec.exit(token)

        return __iter__

    def _wrap_loader_next(self, original):
        rec = self

        def __next__(iterator):
            if not rec.here():
                return original(iterator)
            token = rec.enter("next(DataLoader)", "data_wait")
            try:
                return original(iterator)
            finally:
                rec.exit(token)

        return __next__

    def _wrap_module_call(self, original):
        rec = self
        is_compiling = torch.compiler.is_compiling

        def __call__(module, *args, **kwargs):
            # Only the outermost call is a span: a model's submodules add nothing but cost.
            if rec._in_forward or is_compiling() or not rec.here():
                return original(module, *args, **kwargs)
            rec._in_forward = True
            token = rec.enter(type(module).__name__, "compute")
            try:
                return original(module, *args, **kwargs)
            finally:
                rec._in_forward = False
                rec.exit(token)

        return __call__

    def _wrap_autograd(self, original, name: str):
        rec = self
        is_compiling = torch.compiler.is_compiling

        def wrapper(*args, **kwargs):
            if rec._in_backward or is_compiling() or not rec.here():
                return original(*args, **kwargs)
            rec._in_backward = True
            token = rec.enter(name, "compute")
            try:
                return original(*args, **kwargs)
            finally:
                rec._in_backward = False
                rec.exit(token)

        wrapper.__wrapped__ = original
        return wrapper

    def _wrap_zero_grad(self, original):
        rec = self

        def zero_grad(optimizer, *args, **kwargs):
            if not rec.here():
                return original(optimizer, *args, **kwargs)
            token = rec.enter(f"{type(optimizer).__name__}.zero_grad", "compute")
            try:
                return original(optimizer, *args, **kwargs)
            finally:
                rec.exit(token)

        return zero_grad

    def _on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.here():
            self._optimizer_tokens[id(optimizer)] = self.enter(f"{type(optimizer).__name__}.step", "compute")

    def _on_optimizer_post(self, optimizer, args, kwargs) -> None:
        if not self.here():
            return
        token = self._optimizer_tokens.pop(id(optimizer), None)
        if token is not None:
            self.exit(token)
        if self._explicit_steps:
            return
        # With several optimizers (a GAN, gpulab's per-replica optimizers) the first one to step
        # marks the training step; if it is garbage-collected, the next one takes over.
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            primary = optimizer
        if optimizer is primary:
            self.end_step()

    @contextmanager
    def _phase_span(self, name: str):
        with self.span(name, PHASE_CATEGORY.get(name, "compute")):
            yield

    def _note_loader(self, loader: DataLoader, caller) -> None:
        if id(loader) in self._loaders:
            return
        self._loaders.add(id(loader))
        self._emit({
            "type": "loader",
            "where": user_site(caller),
            "dataset": type(loader.dataset).__name__,
            "batch_size": loader.batch_size,
            "num_workers": loader.num_workers,
            "pin_memory": bool(loader.pin_memory),
            "persistent_workers": bool(loader.persistent_workers),
        })


# ----------------------------------------------------------------------------- reading records back


def read_events(path: Path) -> list[dict]:
    """The records of an events file; a line cut short by a crash is skipped."""
    records = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return records
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class Recording:
    """The records of one session, sorted by kind (the reading side of the format above)."""

    def __init__(self, records: list[dict]):
        self.start: dict = {}
        self.end: dict | None = None
        self.steps: list[dict] = []
        self.tail: dict | None = None
        self.loaders: list[dict] = []
        self.sites: list[dict] = []
        self.hot: dict[str, dict[str, int]] = {}
        self.hot_interval_s = 0.0
        self.span_seconds: dict[str, float] = {}
        self.kernels: dict | None = None
        for r in records:
            kind = r.get("type")
            if kind == "start":
                self.start = r
            elif kind == "end":
                self.end = r
            elif kind == "step":
                self.steps.append(r)
            elif kind == "tail":
                self.tail = r
            elif kind == "loader":
                self.loaders.append(r)
            elif kind == "sites":  # snapshots: the last one is the whole run
                self.sites = r["sites"]
            elif kind == "hot":
                self.hot, self.hot_interval_s = r["lines"], r["interval_s"]
            elif kind == "spans":
                self.span_seconds = r["seconds"]
            elif kind == "kernels":
                self.kernels = r

    @property
    def t_start(self) -> float | None:
        return self.start.get("t")
