"""The CUDA probe: host syncs and host->device copies, each with the user's line, and a "cuda"
record as soon as the script has memory on a GPU (the kernel window is kernels.py's).

A sync (`.item()`, `print(t)`, `.cpu()`, `if t:`, ...) makes the host wait for the device. Two
mechanisms, used together: torch's sync debug mode (sync_debug.py) reports every sync torch
knows of, with the user's line; and the Python entry points that sync are wrapped and timed.
A wrapped call counts as a sync only if torch reported one while it ran (a non_blocking copy to
pinned memory does not); a sync reported inside a call gpulab does not wrap (x[mask]) is
counted, with its line, but not timed. `Tensor.to(cuda)` / `.cuda()` from a CPU tensor are
timed as copies, with their size and whether the source was pinned (from pageable memory the
copy is staged through a driver buffer). Tensor-method wrappers rather than one
TorchFunctionMode, which is entered for every torch op of the step: docs/profiling.md.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from gpulab.monitor.events import CudaUsage
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.probe import Probe
from gpulab.monitor.record.probes.sync_debug import SyncDebugMode

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


def cuda_device_present() -> bool:
    """A CUDA build with a CUDA device to use. torch.cuda.device_count() asks NVML where it can,
    unlike is_available(), which initialises the CUDA driver in a script that may never use the
    GPU (and makes forked DataLoader workers unsafe)."""
    return torch.backends.cuda.is_built() and torch.cuda.device_count() > 0


class CudaSyncProbe(Probe):
    def __init__(self, warmup_steps: int):
        self._warmup_steps = warmup_steps
        self.sites = SyncSites(warmup_steps)
        self._state = _ThreadState()
        self._debug_mode = SyncDebugMode(self._on_sync_reported)
        self._usage_written = False  # the "cuda" record: the script put work on the GPU

    def hook(self) -> None:
        # Only with a CUDA device to use: on a CUDA build without one the wrappers would cost the
        # script's every .to() and tensor repr for nothing (a fifth of a small data fetch).
        if not cuda_device_present():
            return
        self.wrap_sync_points(self.patches.patch)
        self.listen(self.sink.notices.step_ended, self._step_ended)
        self._debug_mode.install(self.patches)  # first out: sync debug mode and the warning filter

    def wrap_sync_points(self, patch) -> None:
        """Replace, through `patch(owner, name, make_wrapper)`, the Python entry points that sync or copy."""
        for name in SYNC_METHODS:
            patch(torch.Tensor, name, lambda orig, name=name: self._timed_sync(orig, f"Tensor.{name}"))
        patch(torch.Tensor, "to", lambda orig: self._timed_copy(orig, "Tensor.to"))
        patch(torch.Tensor, "cuda", lambda orig: self._timed_copy(orig, "Tensor.cuda"))
        for owner, op in ((torch.cuda, "torch.cuda"), (torch.cuda.Event, "Event"), (torch.cuda.Stream, "Stream")):
            patch(owner, "synchronize", lambda orig, op=op: self._timed_sync(orig, f"{op}.synchronize", explicit=True))

    def new_lane(self) -> None:
        self.sites = SyncSites(self._warmup_steps)

    def _note_sync(self, op: str, t0: float, t1: float, where: str | None) -> None:
        sink = self.sink
        sink.steps.add_closed_span(f"sync: {op}", "sync", t0, t1)
        sink.steps.count("sync")
        self.sites.note("sync", op, where, sink.steps_done, seconds=t1 - t0)

    def _on_sync_reported(self) -> None:
        """torch reported a sync (sync debug mode): the timed call around it records it, with its
        duration; else it happened inside a call gpulab does not time (e.g. x[mask])."""
        if self._state.depth:
            self._state.synced = True
        elif self.sink.here():
            self.sink.steps.count("sync_untimed")
            self.sites.note("sync", "untimed", user_site(sys._getframe(2)), self.sink.steps_done, untimed=1)

    def _note_h2d(self, op: str, t0: float, t1: float, nbytes: int, pinned: bool, blocking: bool,
                  where: str | None) -> None:
        """A host-to-device copy. Kinds: h2d_pageable (staged through a driver buffer),
        h2d_pinned_blocking (pinned, but the host waited: no non_blocking=True), h2d_pinned (async)."""
        sink = self.sink
        kind = "h2d_pageable" if not pinned else "h2d_pinned_blocking" if blocking else "h2d_pinned"
        label = "pageable" if not pinned else "pinned, blocking" if blocking else "pinned"
        sink.steps.add_closed_span(f"copy: {op} ({label})", "h2d", t0, t1)
        sink.steps.count(kind)
        sink.steps.count(kind + "_bytes", nbytes)
        self.sites.note(kind, op, where, sink.steps_done, seconds=t1 - t0, nbytes=nbytes)

    def _timed_sync(self, original, op: str, explicit: bool = False):
        """A Tensor method that syncs when its tensor is on CUDA, or (`explicit`) a synchronize."""
        sink, state, mode, note_sync = self.sink, self._state, self._debug_mode, self._note_sync
        is_compiling = torch.compiler.is_compiling

        def wrapper(*args, **kwargs):
            # is_compiling() first: under torch.compile the rest folds away and the call is traced as is.
            if is_compiling() or state.depth or not (explicit or args[0].is_cuda) or not sink.here():
                return original(*args, **kwargs)
            state.depth, state.synced = 1, False
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                t1 = time.perf_counter()
                state.depth = 0
                if explicit or state.synced or not mode.on:  # sync debug mode does not report synchronize
                    note_sync(op, t0, t1, user_site(sys._getframe(1)))

        return wrapper

    def _timed_copy(self, original, op: str):
        sink, state, mode = self.sink, self._state, self._debug_mode
        is_compiling = torch.compiler.is_compiling

        def wrapper(tensor, *args, **kwargs):
            if is_compiling() or state.depth or not sink.here():
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
                    blocking = state.synced if mode.on else not _asks_non_blocking(args, kwargs)
                    self._note_h2d(op, t0, t1, tensor.nbytes, tensor.is_pinned(), blocking, where)
                elif state.synced or not mode.on:
                    self._note_sync(f"{op}(cpu)", t0, t1, where)
            return out

        return wrapper

    def _step_ended(self, steps_done: int) -> None:
        if not torch.cuda.is_initialized():
            return
        if not self._debug_mode.on:
            self._debug_mode.enable()  # a torch without _lazy_call: once CUDA is up
        # The "cuda" record as soon as the script has memory on a GPU: a process that dies before
        # its end record must still read as a GPU job.
        if not self._usage_written and (usage := cuda_usage(self._debug_mode.used))["devices"]:
            self._usage_written = True
            self.sink.emit({"type": "cuda", **usage})

    def snapshots(self) -> list[dict]:
        return [self.sites.snapshot()]

    def end_fields(self) -> dict:
        return {"cuda": cuda_usage(self._debug_mode.used)}


def cuda_usage(sync_debug_used: bool) -> CudaUsage:
    """Did the script use CUDA, and which devices (by UUID, to match NVML's GPUs)?"""
    initialized = torch.backends.cuda.is_built() and torch.cuda.is_initialized()
    out = {"available": torch.cuda.is_available(), "initialized": initialized,
           "sync_debug_mode": sync_debug_used, "devices": []}
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


class SyncSites:
    """The user's lines that made the host wait, per (kind, file:line): ops, calls, seconds,
    untimed syncs, bytes; and the calls and seconds after warm-up (`steady_count`,
    `steady_seconds`), so that a finding about the steps points at the line the steps wait at,
    not at a set-up call (the model's one `.to(device)`, which also pays for CUDA's start-up)."""

    def __init__(self, warmup_steps: int):
        self._sites: dict[str, dict] = {}
        self.warmup_steps = warmup_steps

    def note(self, kind: str, op: str, where: str | None, steps_done: int, seconds: float = 0.0, untimed: int = 0,
             nbytes: int = 0) -> None:
        key = f"{kind}|{where}"
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = {"kind": kind, "where": where, "ops": [], "count": 0, "seconds": 0.0,
                                       "untimed": 0, "bytes": 0, "steady_count": 0, "steady_seconds": 0.0}
        if op not in site["ops"]:
            site["ops"].append(op)
        site["count"] += 1
        site["seconds"] += seconds
        site["untimed"] += untimed
        site["bytes"] += nbytes
        if steps_done >= self.warmup_steps:
            site["steady_count"] += 1
            site["steady_seconds"] += seconds

    def snapshot(self) -> dict:
        return {"type": "sites", "sites": list(self._sites.values())}
