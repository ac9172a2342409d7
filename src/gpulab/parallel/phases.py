"""Timing the phases of a training step without stalling the device.

On CUDA a wall-clock timer around `loss.backward()` measures how long the *launch* took, and
charges the GPU time to whichever later call happens to synchronize. So on CUDA each phase is
bracketed by CUDA events recorded on the device's stream, and the elapsed times are read once,
at `summary()`, after a single synchronize. On the CPU, work is synchronous and wall-clock is
right.

Phase listeners (`add_phase_listener`) see every phase of every PhaseTimer in the process, timed
or not, the way torch's global module hooks see every module: the profiler subscribes to learn
gpulab's own trainer's phases (data, scatter, forward_backward, allreduce, optimizer) without
patching it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack, contextmanager

import torch

PhaseListener = Callable[[str], AbstractContextManager]
"""Called as a phase begins, with its name; the context manager it returns is entered around the phase."""

_listeners: list[PhaseListener] = []


def add_phase_listener(listener: PhaseListener) -> Callable[[], None]:
    """Subscribe `listener` to every phase from now on; returns the function that unsubscribes it."""
    _listeners.append(listener)

    def remove() -> None:
        if listener in _listeners:
            _listeners.remove(listener)

    return remove


class PhaseTimer:
    def __init__(self, devices: list[torch.device], enabled: bool = True):
        """`enabled=False`: time nothing (listeners still see the phases)."""
        self.devices = list(dict.fromkeys(devices))  # unique, in order
        self.enabled = enabled
        self.cuda = any(d.type == "cuda" for d in self.devices)
        self.reset()

    def reset(self) -> None:
        self._events: dict[str, list[tuple]] = defaultdict(list)
        self._wall: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase `name`, inside what the phase listeners wrap around it."""
        if not _listeners:
            with self._timed(name):
                yield
            return
        with ExitStack() as stack:
            for listener in list(_listeners):
                stack.enter_context(listener(name))
            with self._timed(name):
                yield

    @contextmanager
    def _timed(self, name: str):
        if not self.enabled:
            yield
        elif self.cuda:
            starts = [self._record(d) for d in self.devices]
            yield
            ends = [self._record(d) for d in self.devices]
            self._events[name].append((starts, ends))
        else:
            t0 = time.perf_counter()
            yield
            self._wall[name] += time.perf_counter() - t0

    @staticmethod
    def _record(device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(device))
        return e

    def summary(self) -> dict[str, list[float]]:
        """Seconds per phase, one entry per device (CPU: one entry). Synchronizes once."""
        out: dict[str, list[float]] = {k: [v] for k, v in self._wall.items()}
        if self._events:
            for d in self.devices:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
            for name, pairs in self._events.items():
                per_device = [0.0] * len(self.devices)
                for starts, ends in pairs:
                    for j, (s, e) in enumerate(zip(starts, ends)):
                        per_device[j] += (e - s) if isinstance(s, float) else s.elapsed_time(e) / 1000
                out[name] = per_device
        return out
