"""The one narrow way a probe writes into the recording: the sink hands each probe what it writes
to, and says whose thread is calling and when gpulab itself is at work.

    steps                      the step accounting (steps.py): spans (enter/exit, closed ones),
                               counts, the step rules (a loop back for data after a backward, an
                               optimizer step, an explicit mark), the category charged now
    notices                    what probes tell one another (notices.py: each a Notice to listen to or send)
    emit(record)               a record for the events file (monitor/events.py is the format)
    here()                     is the caller the recorded (training) thread? Only its calls count
    here_or_adopted()          the same, where the first thread to train becomes the recorded one
    span(name, category)       a span as a context manager, in the recorded thread only
    own_work()                 gpulab's own work (a window's profiler, its synchronize): no
                               probe takes it for the script's, no stack sample either
    steps_done                 where the step accounting stands

A forked child keeps its sink: the step accounting starts again in place (steps.new_lane), so
what the sink hands out stays valid - and a wrapper on the hot path (a module call, backward, a
timed call) may take `sink.steps` once, when it is made, rather than at every call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager

from gpulab.monitor.record.notices import Notices
from gpulab.monitor.record.steps import StepAccounting


class Sink:
    def __init__(self, steps: StepAccounting, emit: Callable[[dict], None], notices: Notices):
        self.ident: int | None = None  # the recorded thread (the recorder sets it; None: none)
        self.steps = steps
        self.emit = emit
        self.notices = notices
        self._guards: list[Callable] = []
        self.own_work_since: float | None = None  # perf_counter when gpulab's own work began; None: none under way
        self.own_work_done = 0.0  # seconds of it that have ended, in all

    def here(self) -> bool:
        """Is the caller the recorded (training) thread?"""
        return threading.get_ident() == self.ident

    def here_or_adopted(self) -> bool:
        """here(), after making the caller the recorded thread if it trains (it calls backward or
        an optimizer's step) while the recorded one, the thread that imported torch, never has: a
        script that trains in a thread of its own."""
        caller = threading.get_ident()
        if caller != self.ident and self.ident is not None and self.steps.backward_calls == self.steps.optimizer_steps == 0:
            self.ident = caller
        return caller == self.ident

    @property
    def steps_done(self) -> int:
        return self.steps.index

    @contextmanager
    def span(self, name: str, category: str):
        if not self.here():
            yield
            return
        token = self.steps.enter(name, category)
        try:
            yield
        finally:
            self.steps.exit(token)

    def guard_own_work(self, guard: Callable) -> Callable[[], None]:
        """`guard()`: a context manager inside which a probe records nothing (the CUDA probe's
        wrappers); own_work() enters every guard. Returns the undo."""
        self._guards.append(guard)
        return lambda: self._guards.remove(guard) if guard in self._guards else None

    @contextmanager
    def own_work(self):
        """Around gpulab's own work in the recorded thread (between every two steps: a window's
        measurement, its profilers and synchronize): no probe takes it for the script's, and the
        stack sampler leaves its time out of the script's lines."""
        self.own_work_since = time.perf_counter()
        try:
            with ExitStack() as stack:
                for guard in list(self._guards):
                    stack.enter_context(guard())
                yield
        finally:
            self.own_work_done += time.perf_counter() - self.own_work_since
            self.own_work_since = None

    def own_work_seconds(self) -> tuple[float, bool]:
        """(seconds of gpulab's own work so far, the part under way included; is it under way?)"""
        since = self.own_work_since
        if since is None:
            return self.own_work_done, False
        return self.own_work_done + time.perf_counter() - since, True
