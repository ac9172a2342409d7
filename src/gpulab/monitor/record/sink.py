"""What a probe writes into the recording through: the step accounting (`steps`: spans, counts,
the step rules), the notices it sends and hears, emit(record); and whose thread is calling
(here()) and when gpulab itself is at work (own_work()).

A forked child keeps its sink: the step accounting starts again in place (steps.new_lane), so a
wrapper on the hot path may take `sink.steps` once, when it is made, rather than at every call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from gpulab.monitor.record.notices import Notices
from gpulab.monitor.record.steps import StepAccounting


class Sink:
    def __init__(self, steps: StepAccounting, emit: Callable[[dict], None], notices: Notices):
        self.ident: int | None = None  # the recorded thread (the recorder sets it; None: none)
        self.steps = steps
        self.emit = emit
        self.notices = notices
        self.own_work_since: float | None = None  # perf_counter when gpulab's own work began; None: none under way
        self.own_work_done = 0.0  # seconds of it that have ended, in all

    def new_lane(self, ident: int) -> None:
        """In a forked child: `ident`, the forking thread, is its only thread; gpulab's own work, if
        the parent's training thread was in some, stayed in the parent (else here() is False for good)."""
        self.ident = ident
        self.own_work_since, self.own_work_done = None, 0.0

    def here(self) -> bool:
        """Is the caller the recorded (training) thread, outside gpulab's own work? Only its calls count."""
        return threading.get_ident() == self.ident and self.own_work_since is None

    def here_or_adopted(self) -> bool:
        """here(), after making the caller the recorded thread if it trains (it calls backward or
        an optimizer's step) while the recorded one, the thread that imported torch, never has: a
        script that trains in a thread of its own."""
        caller = threading.get_ident()
        if caller != self.ident and self.ident is not None and self.steps.backward_calls == self.steps.optimizer_steps == 0:
            self.ident = caller
        return caller == self.ident and self.own_work_since is None

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

    @contextmanager
    def own_work(self):
        """Around gpulab's own work in the recorded thread (a window's measurement, its profilers
        and synchronize): no probe takes it for the script's (here() is False), and the stack
        sampler leaves its time out of the script's lines."""
        self.own_work_since = time.perf_counter()
        try:
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
