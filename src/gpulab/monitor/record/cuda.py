"""CUDA-only instrumentation: host syncs and host->device copies (and, through kernels.py, a
short kernel capture).

Host syncs. A CUDA call returns before the GPU has run it; `.item()`, `print(t)`, `.cpu()`,
`if t:` and friends make the host wait until the device has caught up, so the GPU idles while
Python prepares the next step. Two mechanisms, used together:
- torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) makes torch report every
  synchronizing operation it knows of as a warning; gpulab intercepts those warnings (the user
  never sees them) and notes the user's line;
- the Python-level entry points that sync (Tensor.item/tolist/cpu/numpy/nonzero, bool/int/float/
  index/repr/format of a tensor, Tensor.to(cpu), torch.cuda.synchronize, Event/Stream.synchronize)
  are wrapped and timed, so the time the host sat blocked is known. A wrapped call counts as a
  sync only if torch reported one while it ran (a non_blocking copy to pinned memory does not).
  Syncs torch reports inside calls gpulab does not wrap (boolean-mask indexing, ...) are counted,
  with their line, but not timed.

Copies. `Tensor.to(cuda)` / `.cuda()` from a CPU tensor are timed, with their size and whether
the source was pinned: from pageable memory the copy is staged through a driver buffer and, unless
non_blocking, waits for the device like a sync.

Why Tensor-method wrappers and not one torch.overrides.TorchFunctionMode, which sees the same
calls: a mode is entered for every torch op of the step, the wrappers only for these methods
(docs/profiling.md has the measurement).

Nothing here is installed without a CUDA device.
"""

from __future__ import annotations

import re
import sys
import threading
import time
import warnings
from contextlib import contextmanager

import torch

from gpulab.monitor.events import CudaRecord, CudaUsage
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.kernels import KernelWindow

SYNC_WARNING = "called a synchronizing CUDA operation"

# Tensor methods that wait for the device when called on a CUDA tensor.
SYNC_METHODS = (
    "item", "tolist", "numpy", "cpu", "nonzero",
    "__bool__", "__int__", "__float__", "__index__", "__repr__", "__format__",
)


class _ThreadState(threading.local):
    depth = 0  # >0 while inside a timed call: nested calls are part of it
    synced = False  # torch reported a sync during the current timed call


def _asks_non_blocking(args: tuple, kwargs: dict) -> bool:
    """Whether a Tensor.to / Tensor.cuda call asked for non_blocking (keyword, or the positional
    bool that follows the device/dtype in `to(device, dtype, non_blocking)` / `cuda(device, non_blocking)`)."""
    if "non_blocking" in kwargs:
        return bool(kwargs["non_blocking"])
    return any(isinstance(a, bool) and a for a in args[:3])


class CudaHooks:
    def __init__(self, recorder, window_after_step: int, window_steps: int):
        self.rec = recorder
        self.enabled = False
        self.sync_debug = False  # torch's sync debug mode is on (our sync detector)
        self.sync_debug_used = False  # ... and was, at some point of the session
        self._previous_debug_mode = 0
        self._state = _ThreadState()
        self._warning_filter = None
        self._original_showwarning = None
        self.window = KernelWindow(recorder.writer.emit, window_after_step, window_steps)
        self._usage_written = False  # the "cuda" record: the script put work on the GPU

    @property
    def window_active(self) -> bool:
        return self.window.active

    # ------------------------------------------------------------------ install

    def install(self, patch) -> None:
        # Only with a CUDA device to use: on a CUDA build without one the wrappers would cost the
        # script's every .to() and tensor repr for nothing (issue 28: ~1 ms of mnist_rnn's 5.5 ms
        # fetch of 64 samples). torch.cuda.device_count() asks NVML where it can, unlike
        # is_available(), which initialises the CUDA driver in a script that may never use the GPU
        # (and makes forked DataLoader workers unsafe). With a device the wrappers are inert until
        # a CUDA tensor shows up.
        if not torch.backends.cuda.is_built() or torch.cuda.device_count() == 0:
            return
        self.enabled = True
        self._intercept_sync_warnings()
        # Enabling sync debug mode needs CUDA initialised; don't initialise it ourselves (a script
        # that never uses the GPU must not get a CUDA context, or fork-unsafe DataLoader workers):
        # queue it to run when the script's first CUDA call initialises CUDA.
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if lazy_call is not None:
            lazy_call(self._enable_sync_debug)
        self.wrap_sync_points(patch)

    def wrap_sync_points(self, patch) -> None:
        """Replace, through `patch(owner, name, make_wrapper)`, the Python entry points that sync or copy."""
        for name in SYNC_METHODS:
            patch(torch.Tensor, name, lambda orig, name=name: self._timed_sync(orig, f"Tensor.{name}"))
        patch(torch.Tensor, "to", lambda orig: self._timed_copy(orig, "Tensor.to"))
        patch(torch.Tensor, "cuda", lambda orig: self._timed_copy(orig, "Tensor.cuda"))
        patch(torch.cuda, "synchronize", lambda orig: self._timed_explicit(orig, "torch.cuda.synchronize"))
        patch(torch.cuda.Event, "synchronize", lambda orig: self._timed_explicit(orig, "Event.synchronize"))
        patch(torch.cuda.Stream, "synchronize", lambda orig: self._timed_explicit(orig, "Stream.synchronize"))

    def uninstall(self) -> None:
        if not self.enabled:
            return
        self.enabled = False
        if self.sync_debug and torch.cuda.is_initialized():
            torch.cuda.set_sync_debug_mode(self._previous_debug_mode)
        self.sync_debug = False
        if warnings.showwarning is self._showwarning:
            warnings.showwarning = self._original_showwarning
        if self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            warnings._filters_mutated()

    def _enable_sync_debug(self) -> None:
        if not self.enabled or self.sync_debug:
            return
        try:
            self._previous_debug_mode = torch.cuda.get_sync_debug_mode()
            # Turning the mode on warns once that it "is a prototype feature": a note to gpulab,
            # not to the user, whose stderr it would otherwise reach.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
                torch.cuda.set_sync_debug_mode("warn")
            self.sync_debug = self.sync_debug_used = True
        except (AttributeError, RuntimeError):
            self.sync_debug = False

    def _intercept_sync_warnings(self) -> None:
        # "always": Python's default shows a warning once per line, and every sync counts.
        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))
        self._warning_filter = warnings.filters[0]
        self._original_showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(SYNC_WARNING):
            self._on_sync_reported()
            return
        self._original_showwarning(message, category, filename, lineno, file, line)

    def _on_sync_reported(self) -> None:
        if self._state.depth:
            self._state.synced = True  # the timed call around us records it, with its duration
        elif self.rec.here():
            self.rec.add_untimed_sync(user_site(sys._getframe(2)))

    @contextmanager
    def suppressed(self):
        """gpulab's own CUDA calls (profiler start/stop) are not the user's syncs."""
        self._state.depth += 1
        try:
            yield
        finally:
            self._state.depth -= 1

    # ------------------------------------------------------------------ wrappers

    def _timed_sync(self, original, op: str):
        rec, state, hooks = self.rec, self._state, self
        is_compiling = torch.compiler.is_compiling

        def wrapper(tensor, *args, **kwargs):
            # is_compiling() first: under torch.compile the rest folds away and the call is traced as is.
            if is_compiling() or state.depth or not tensor.is_cuda or not rec.here():
                return original(tensor, *args, **kwargs)
            state.depth, state.synced = 1, False
            t0 = time.perf_counter()
            try:
                return original(tensor, *args, **kwargs)
            finally:
                t1 = time.perf_counter()
                state.depth = 0
                if state.synced or not hooks.sync_debug:
                    rec.add_sync(op, t0, t1, user_site(sys._getframe(1)))

        return wrapper

    def _timed_copy(self, original, op: str):
        rec, state, hooks = self.rec, self._state, self
        is_compiling = torch.compiler.is_compiling

        def wrapper(tensor, *args, **kwargs):
            if is_compiling() or state.depth or not rec.here():
                return original(tensor, *args, **kwargs)
            from_cuda = tensor.is_cuda
            state.depth, state.synced = 1, False
            t0 = time.perf_counter()
            try:
                out = original(tensor, *args, **kwargs)
            finally:
                state.depth = 0
            t1 = time.perf_counter()
            if isinstance(out, torch.Tensor) and out is not tensor and out.is_cuda != from_cuda:
                where = user_site(sys._getframe(1))
                if out.is_cuda:
                    # Pinned memory only lets a copy run asynchronously; without non_blocking=True
                    # the host still waits for it. Torch's sync debug mode reports exactly those
                    # copies (measured on an H100, torch 2.11: pinned+blocking warns,
                    # pinned+non_blocking does not); without that mode, read the argument.
                    blocking = state.synced if hooks.sync_debug else not _asks_non_blocking(args, kwargs)
                    rec.add_h2d(op, t0, t1, tensor.nbytes, tensor.is_pinned(), blocking, where)
                elif state.synced or not hooks.sync_debug:
                    rec.add_sync(f"{op}(cpu)", t0, t1, where)
            return out

        return wrapper

    def _timed_explicit(self, original, op: str):
        rec, state = self.rec, self._state

        def wrapper(*args, **kwargs):
            if state.depth or not rec.here():
                return original(*args, **kwargs)
            state.depth = 1
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                state.depth = 0
                rec.add_sync(op, t0, t1, user_site(sys._getframe(1)))

        return wrapper

    # ------------------------------------------------------------------ steps and the end

    def on_step_end(self, steps_done: int) -> None:
        if not self.enabled:
            return
        if not self.sync_debug and torch.cuda.is_initialized():
            self._enable_sync_debug()  # torch without _lazy_call: enable once CUDA is up
        if not self._usage_written and torch.cuda.is_initialized():
            self._write_usage()
        self.window.on_step_end(steps_done)

    def _write_usage(self) -> None:
        """Once the script has memory on a GPU, say so at once: a process that dies before its end
        record must still read as a GPU job, not as one that never used the GPU (issue 33)."""
        usage = self.usage()
        if usage["devices"]:
            self._usage_written = True
            record: CudaRecord = {"type": "cuda", **usage}
            self.rec.writer.emit(record)

    def finish(self, steps_done: int) -> None:
        if self.enabled:
            self.window.finish(steps_done)

    def usage(self) -> CudaUsage:
        """Did the script use CUDA, and which devices (by UUID, to match NVML's GPUs)?"""
        initialized = torch.backends.cuda.is_built() and torch.cuda.is_initialized()
        out = {"available": torch.cuda.is_available(), "initialized": initialized,
               "sync_debug_mode": self.sync_debug_used, "devices": []}
        if not initialized:
            return out
        for i in range(torch.cuda.device_count()):
            peak = torch.cuda.max_memory_allocated(i)
            if peak == 0:
                continue
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({
                "index": i,
                "name": props.name,
                "uuid": str(getattr(props, "uuid", "")),
                "capability": f"{props.major}.{props.minor}",
                "peak_allocated_mib": peak / 2**20,
            })
        return out
