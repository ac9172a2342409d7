"""One training step's memory, measured: live bytes over the step, the peak, and what the peak
is made of.

How (public torch APIs where they exist; nothing of the script changes, nothing of its tensors'
lives either):
- every allocation and free of the step: the autograd profiler with profile_memory=True records
  each one of torch's allocators (CPU and CUDA) with its address, size and time (allocations.py
  reads them). The live bytes at the step's start come from the CUDA allocator
  (`memory_allocated`) or, on a CPU, where torch keeps no count, from every tensor the script's
  frames reach at that step boundary (tensors.reachable_from). The profiler starts one step
  before the measured one (`prepare`): it reports the free of a block only if it saw the block
  allocated, and the previous step's batch, gradients and outputs are freed during the next one.
- the split at the peak, from what is known to hold memory, each piece from the moment it
  appeared to the free of its storage (the allocator's record at its address):
    parameters and buffers      of the modules the step called (constant)
    optimizer state             every tensor in the stepped optimizers' `state` (constant)
    gradients                   `.grad` of those parameters: there at the start, made during
                                backward (post-accumulate-grad hooks), freed by zero_grad
    activations                 every tensor autograd saves for backward
                                (torch.autograd.graph.saved_tensors_hooks), except parameters
                                and the batch, counted once per storage, charged to the
                                innermost module running when it was saved
    inputs                      the batch
    other_kept                  what is still live after the step that none of the above
                                explains (a dataset in memory, outputs the script keeps)
    temporaries                 the rest of the peak: intermediate results not saved for
                                backward, an optimizer's scratch buffers
What the probe reads of a tensor is integers (tensors.storage_span); it keeps no reference to
one, puts no weak reference or finalizer on one and asks for no storage object (a profiler
that holds such things on a CUDA job's tensors crashes jobs at garbage collection). Everything here runs for the measured step only (its cost: a few microseconds per
saved tensor and per allocation; on a CPU one walk over the script's objects).
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

from gpulab.io import native_stderr_hidden
from gpulab.memory.allocations import Allocations, allocations_of
from gpulab.memory.records import StepMemory
from gpulab.memory.tensors import (Storages, gradients, optimizer_state, parameters_and_buffers, reachable_from,
                                   script_roots, storage_span, tensors_in)
from gpulab.signals import threads_started_inside_block_signals

MAX_CURVE_POINTS = 400
TOP_MODULES = 8


class _Timeline:
    """Bytes of one kind over the step: (time, +bytes) when a piece appears, (time, -bytes) when it
    goes; `at(t)` is what was there at time t."""

    def __init__(self, start_bytes: int = 0):
        self.start_bytes = start_bytes
        self.changes: list[tuple[float, int]] = []

    def add(self, nbytes: int, t: float | None = None) -> None:
        self.changes.append((time.perf_counter() if t is None else t, nbytes))

    def at(self, t: float) -> int:
        return self.start_bytes + sum(n for when, n in self.changes if when <= t)

    def largest(self) -> int:
        level = best = self.start_bytes
        for _, n in sorted(self.changes):
            level += n
            best = max(best, level)
        return best


class _Noted:
    """Storages of one kind noted during the step, by key: (bytes, when noted in wall-clock ns).
    Their lives are read from the allocator's records at the end (`timeline`)."""

    def __init__(self):
        self.by_key: dict[tuple[str, int], tuple[int, int]] = {}

    def note(self, key: tuple[str, int], nbytes: int, t_ns: int) -> bool:
        """Note a storage the first time it is seen; whether it was new."""
        if key in self.by_key:
            return False
        self.by_key[key] = (nbytes, t_ns)
        return True

    def timeline(self, allocations: Allocations, to_perf: Callable[[int], float], since_ns: int,
                 until_ns: int) -> _Timeline:
        """Each storage from its allocation (the step's start, for one made before it; when noted,
        where the allocator's records do not say) to its free, if that came in the step. From its
        allocation, not from when it was noted: a gradient is noted when backward hands it over,
        after the allocation that may be the step's peak."""
        timeline = _Timeline()
        for (_, ptr), (nbytes, t_ns) in self.by_key.items():
            nbytes = allocations.size_at(ptr, t_ns) or nbytes
            allocated_ns = allocations.allocated_at(ptr, t_ns)
            timeline.add(nbytes, to_perf(max(allocated_ns, since_ns) if allocated_ns is not None else t_ns))
            freed_ns = allocations.freed_after(ptr, t_ns)
            if freed_ns is not None and freed_ns <= until_ns:
                timeline.add(-nbytes, to_perf(freed_ns))
        return timeline

    @property
    def nbytes(self) -> int:
        return sum(nbytes for nbytes, _ in self.by_key.values())


class StepMemoryProbe:
    """Measures one step on `device`: `prepare()` one step before it, `begin(modules, optimizers)`
    at its start, `note_inputs(batch)` when its batch is known, `end()` at its end -> StepMemory.
    `close()` undoes everything (also after a failure). Every call comes from the training thread."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._profiler = None
        self._undo: list = []
        self._begun = False

    # ------------------------------------------------------------------ the step before

    def prepare(self) -> None:
        # torch.autograd.profiler's profile, not torch.profiler's: the latter's first start imports
        # torch._inductor to read one setting (1.1-1.4 s measured here, in the middle of the loop).
        self._profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
        before = torch.empty(256)  # allocated before the profiler starts, freed right after:
        with native_stderr_hidden(), threads_started_inside_block_signals():
            self._profiler.__enter__()
            # c10 warns once per process, on stderr, when a block from before the profiler is
            # freed; it is gpulab's to see, not the user's: have it now, hidden.
            del before

    # ------------------------------------------------------------------ the measured step

    def begin(self, modules: list[torch.nn.Module], optimizers: list[torch.optim.Optimizer],
              per_module: bool = True, held: list = ()) -> None:
        """`per_module`: charge each saved tensor to the module that saved it, through global module
        hooks - which torch.compile guards on: compiled code recompiles when they come and go, so a
        compiling process measures without them (every activation then "(outside any module)").
        `held`: what holds the script's tensors out of its frames' locals, for a CPU's count - the
        DataLoader iterators `for` loops keep, with the batches their workers sent ahead."""
        if self._profiler is None:
            self.prepare()
        self._begun = True
        self.modules, self.optimizers = list(modules), list(optimizers)
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.live_start = torch.cuda.memory_allocated(self.device)
            self.how = "CUDA caching allocator (memory_allocated) + the autograd profiler's allocation records"
        else:
            self.live_start = reachable_from(script_roots(sys._getframe(1)) + list(held), self.device).nbytes
            self.how = ("tensors the script reaches at the step's start + the autograd profiler's allocation "
                        "records (the CPU allocator keeps no count)")
        self._anchor = (time.time_ns(), time.perf_counter())
        self.t_begin = time.perf_counter()
        self.begin_ns = time.time_ns()
        self.params = Storages(self.device).add_all(parameters_and_buffers(self.modules))
        self.inputs = Storages(self.device)
        self._inputs = _Noted()
        self.batch: int | None = None
        self._grads_at_start = Storages(self.device).add_all(gradients(self.modules, self.optimizers))
        self._grads_made = _Noted()
        self._saved = _Noted()
        self.by_module: dict[str, int] = defaultdict(int)
        self._module_classes: dict[str, str] = {}
        self._names = {id(m): name for root in self.modules for name, m in _named(root)}
        self._stack: list[str] = []
        if per_module:
            self._watch_modules()
        self._watch_new_gradients()
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        hooks.__enter__()
        self._undo.append(lambda: hooks.__exit__(None, None, None))

    def note_inputs(self, batch) -> None:
        """The step's batch (a tensor, or a nested list/tuple/dict of them). A tensor autograd made
        (a model's output handed to the next model, a recomputed checkpoint's) is no batch."""
        if not self._begun:
            return
        for t in tensors_in(batch):
            if t.grad_fn is not None or t.requires_grad:
                continue
            if self.inputs.add(t):
                span = storage_span(t)
                self._inputs.note(span[0], span[1], time.time_ns())
                if self.batch is None and t.dim():
                    self.batch = t.shape[0]

    def end(self) -> StepMemory:
        end_ns = time.time_ns()
        self.t_end = time.perf_counter()
        self._unhook()
        self._stop_profiler()
        allocations = allocations_of(self._profiler, self.device)
        curve = self._curve(allocations, end_ns)
        live_end = curve[-1][1] if curve else self.live_start
        peak_t, peak = max(curve, key=lambda point: point[1]) if curve else (None, self.live_start)
        reserved = None
        if self.cuda:
            peak = max(peak, torch.cuda.max_memory_allocated(self.device))  # the allocator's own count wins
            reserved = torch.cuda.memory_reserved(self.device)
        grads = self._gradients(allocations, end_ns)
        activations = self._saved.timeline(allocations, self._to_perf, self.begin_ns, end_ns)
        inputs = self._inputs.timeline(allocations, self._to_perf, self.begin_ns, end_ns)
        optimizer_bytes = Storages(self.device).add_all(t for t in optimizer_state(self.optimizers) if t not in self.params).nbytes
        at_t = peak_t if peak_t is not None else self.t_end
        parts = {
            "parameters": self.params.nbytes,
            "gradients": grads.at(at_t),
            "optimizer_state": optimizer_bytes,
            "activations": activations.at(at_t),
            "inputs": inputs.at(at_t),
        }
        kept_after = self.params.nbytes + optimizer_bytes + grads.at(self.t_end) + inputs.at(self.t_end)
        parts["other_kept"] = max(0, live_end - kept_after - activations.at(self.t_end))
        parts["temporaries"] = max(0, peak - sum(parts.values()))
        sizes = {
            "parameters": self.params.nbytes,
            "gradients": grads.largest(),
            "optimizer_state": optimizer_bytes,
            "activations": self._saved.nbytes,
            "inputs": self.inputs.nbytes,
        }
        top = sorted(self.by_module.items(), key=lambda kv: kv[1], reverse=True)[:TOP_MODULES]
        self.close()
        return {
            "device": str(self.device), "how": self.how, "live_start": self.live_start, "peak": peak, "peak_t": peak_t,
            "live_end": live_end, "at_peak": _fit_to(parts, peak), "sizes": sizes,
            "activations_by_module": [[name, self._module_classes.get(name, ""), n] for name, n in top],
            "batch": self.batch, "reserved": reserved, "curve": _downsampled(curve),
        }

    def close(self) -> None:
        """Undo the hooks and stop the profiler, whatever state the probe is in; let go of the
        script's modules and optimizers."""
        self._unhook()
        self.modules, self.optimizers = [], []
        try:
            self._stop_profiler()
        except Exception:
            pass  # stopped already, or never started
        self._profiler = None

    def _stop_profiler(self) -> None:
        if self._profiler is not None and self._profiler.kineto_results is None:
            with native_stderr_hidden():
                self._profiler.__exit__(None, None, None)

    def _unhook(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _to_perf(self, t_ns: int) -> float:
        wall0, perf0 = self._anchor
        return perf0 + (t_ns - wall0) / 1e9

    # ------------------------------------------------------------------ what the step holds

    def _pack(self, t: torch.Tensor):
        span = storage_span(t)
        if span is None or span[0][0] != str(self.device) or t in self.params or t in self.inputs:
            return t
        key, nbytes = span
        if self._saved.note(key, nbytes, time.time_ns()):
            module = self._stack[-1] if self._stack else "(outside any module)"
            self.by_module[module] += nbytes
        # An alias, not `t`: an output saved by its own node would otherwise hold itself.
        return t.detach()

    def _watch_modules(self) -> None:
        """A stack of the modules running, to charge each saved tensor to the innermost one."""

        def before(module, args):
            name = self._names.get(id(module))
            if name is not None:
                self._module_classes.setdefault(name, type(module).__name__)
                self._stack.append(name)

        def after(module, args, output):
            if self._names.get(id(module)) is not None and self._stack:
                self._stack.pop()

        for handle in (register_module_forward_pre_hook(before), register_module_forward_hook(after, always_call=True)):
            self._undo.append(handle.remove)

    def _watch_new_gradients(self) -> None:
        """Every gradient backward makes or adds to (on CUDA, in autograd's device thread): its
        storage, noted the first time; `_gradients` tells new ones from those there at the start."""

        def made(param: torch.Tensor) -> None:
            span = storage_span(param.grad) if param.grad is not None else None
            if span is not None:
                self._grads_made.note(span[0], span[1], time.time_ns())

        for m in self.modules:
            for p in m.parameters():
                if p.requires_grad:
                    self._undo.append(p.register_post_accumulate_grad_hook(made).remove)

    def _gradients(self, allocations: Allocations, end_ns: int) -> _Timeline:
        """The gradients over the step: those there at the start until freed (zero_grad with
        set_to_none), and those backward made from when each was made. A gradient backward only
        added to is the one there at the start (its storage, not freed before)."""
        timeline = _Timeline(self._grads_at_start.nbytes)
        freed_at_start = {}
        for key, nbytes in self._grads_at_start.bytes_by_key.items():
            freed_at_start[key] = freed_ns = allocations.freed_after(key[1], self.begin_ns)
            if freed_ns is not None and freed_ns <= end_ns:
                timeline.add(-nbytes, self._to_perf(freed_ns))
        made = _Noted()
        for key, (nbytes, t_ns) in self._grads_made.by_key.items():
            there = key in freed_at_start and (freed_at_start[key] is None or freed_at_start[key] > t_ns)
            if not there:
                made.note(key, nbytes, t_ns)
        timeline.changes += made.timeline(allocations, self._to_perf, self.begin_ns, end_ns).changes
        return timeline

    def _curve(self, allocations: Allocations, end_ns: int) -> list[list[float]]:
        """Live bytes after each allocation or free of the step, on this device."""
        live, curve = self.live_start, [[self.t_begin, self.live_start]]
        for t_ns, nbytes in allocations.changes_between(self.begin_ns, end_ns):
            live += nbytes
            curve.append([self._to_perf(t_ns), live])
        return curve


def measure_step(one_step: Callable[..., object], device: torch.device, modules: list[torch.nn.Module],
                 optimizers: list[torch.optim.Optimizer]) -> StepMemory:
    """One training step's memory, outside the profiler (gpulab plan's children): the probe starts
    in one call of `one_step()` and measures the next, `one_step(note_batch=...)`, which tells it
    the step's batch."""
    probe = StepMemoryProbe(device)
    try:
        probe.prepare()
        one_step()
        probe.begin(modules, optimizers)
        one_step(note_batch=probe.note_inputs)
        return probe.end()
    finally:
        probe.close()


def _named(root: torch.nn.Module):
    """(qualified name, module) of every module under `root`; the root is its class name."""
    for name, module in root.named_modules():
        yield (name or type(root).__name__), module


def _unpack(alias: torch.Tensor) -> torch.Tensor:
    return alias


def _fit_to(parts: dict[str, int], peak: int) -> dict[str, int]:
    """The parts as measured, scaled down proportionally if together they exceed the peak (each
    is measured separately, so they can overlap a little: a saved tensor that is also kept)."""
    total = sum(parts.values())
    if total <= peak or total == 0:
        return parts
    return {k: int(v * peak / total) for k, v in parts.items()}


def _downsampled(curve: list[list[float]]) -> list[list[float]]:
    if len(curve) <= MAX_CURVE_POINTS:
        return curve
    per = len(curve) / MAX_CURVE_POINTS
    out = []
    for i in range(MAX_CURVE_POINTS):
        chunk = curve[int(i * per):int((i + 1) * per)] or curve[-1:]
        out.append(max(chunk, key=lambda point: point[1]))
    return out
