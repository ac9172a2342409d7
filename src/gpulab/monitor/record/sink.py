"""The one narrow way a probe writes into the recording.

    here()                     is the caller the recorded (training) thread? Only its calls count
    enter(name, category)      a span opens: time from now is charged to `category` ...
    exit(token)                ... until it closes (any span left open above it closes too)
    closed_span(name, category, t0, t1)   a span classified only after it returned (a sync)
    span(name, category)       the same as a context manager
    count(key, n)              add to this step's count `key` (syncs, copies, their bytes)
    emit(record)               a record for the events file (monitor/events.py is the format)
    loop_is_back()             the step rules (steps.py): the loop came back for data or a
    backward_finished()        forward; a top-level backward finished; an optimizer stepped; an
    optimizer_stepped(opt)     explicit step mark (the Python API's p.step())
    mark_step()
    listen(notice, listener) / send(notice, ...) / sender(notice)   notices (notices.py)
    own_work()                 gpulab's own work (a window's profiler, its synchronize): no
                               probe takes it for the script's, no stack sample either
    steps_done, loading_data(), charged_category()   where the step accounting stands

A forked child keeps its sink: the step accounting starts again in place (steps.new_lane), so
what the sink hands out stays valid.
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
        self._steps = steps
        self._guards: list[Callable] = []
        self.own_work_since: float | None = None  # perf_counter when gpulab's own work began; None: none under way
        self.own_work_done = 0.0  # seconds of it that have ended, in all
        # The step accounting's own methods, not wrappers around them: a probe calls these a few
        # times per step (the spans of forward, backward, the optimizer, each fetch), and each
        # wrapper would be one more Python call on the script's time.
        self.enter = steps.enter
        self.exit = steps.exit
        self.closed_span = steps.add_closed_span
        self.count = steps.count
        self.loading_data = steps.loading_data
        self.charged_category = steps.charged_category
        self.loop_is_back = steps.end_step_after_backward
        self.backward_finished = steps.backward_done
        self.optimizer_stepped = steps.optimizer_stepped
        self.mark_step = steps.mark_step
        self.emit = emit
        self.listen = notices.listen
        self.send = notices.send
        self.sender = notices.sender

    def here(self) -> bool:
        """Is the caller the recorded (training) thread?"""
        return threading.get_ident() == self.ident

    @property
    def steps_done(self) -> int:
        return self._steps.index

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
