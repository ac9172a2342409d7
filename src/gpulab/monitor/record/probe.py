"""What every probe is: one recorded concern that puts its own hooks and patches in, writes only
through the sink, hears what other probes see only from notices, and takes its hooks out again.

The recorder calls, on each probe in turn: install(sink); after_fork() in any forked child (drop
what stayed in the parent: a timer, a thread); new_lane() in a forked child that records as its
own lane (tally again from zero); finish() as the run ends, hooks still in; remove(); and
snapshots(), facts(), end_fields() for the records it writes (snapshots are also read from the
writer's thread: they may not call into torch's running parts).
"""

from __future__ import annotations

from collections.abc import Callable

from gpulab.monitor.record.notices import Notice
from gpulab.monitor.record.patches import Patches
from gpulab.monitor.record.sink import Sink


class Probe:
    sink: Sink
    patches: Patches

    def install(self, sink: Sink) -> None:
        self.sink = sink
        self.patches = Patches()
        self.hook()

    def hook(self) -> None:
        """Put this probe's hooks and patches in (through self.patches and self.listen)."""

    def listen(self, notice: Notice, listener: Callable) -> None:
        """Listen to `notice` until the probe is removed."""
        self.patches.on_undo(notice.listen(listener))

    def after_fork(self) -> None:
        pass

    def new_lane(self) -> None:
        pass

    def finish(self) -> None:
        pass

    def remove(self) -> None:
        self.patches.undo()

    def snapshots(self) -> list[dict]:
        return []

    def facts(self) -> dict:
        return {}

    def end_fields(self) -> dict:
        return {}


class WindowProbe(Probe):
    """A probe that measures in a window of steps after warm-up, its steps left out of the
    statistics. The windows take turns, in the recorder's order (kernels, memory, transforms, operators):
    two torch profilers cannot run at once, and a step measured by one would carry another's cost."""

    active = False  # is the next step inside this window?
    finished = False  # done for good in this lane: nothing left to open, measure or close

    @property
    def holds_back_later_windows(self) -> bool:
        """May a later window not open now (this one is open, or about to)?"""
        return self.active

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        """Between two steps: open (when `may_open`), measure, or close."""


class PhasedWindow(WindowProbe):
    """A window whose state is one phase, from "warm-up" through "window" (active) to "done" (finished)."""

    _phase = "warm-up"

    @property
    def active(self) -> bool:
        return self._phase == "window"

    @property
    def finished(self) -> bool:
        return self._phase == "done"


def take_turns(windows: list[WindowProbe], steps_done: int) -> bool:
    """Let each window open, measure or close; whether the next step is inside one."""
    may_open = True
    for window in windows:
        window.on_step_end(steps_done, may_open)
        may_open = may_open and not window.holds_back_later_windows
    return any(window.active for window in windows)


def timed(sink: Sink, category: str, name, before=None, after=None):
    """A make_wrapper for Patches.patch: the call, in the recorded thread, as a `category` span.
    `name`: the span's, or a function of the call's first argument that gives it;
    `before(first argument)`, `after(result)`: what the probe notes around it."""
    steps = sink.steps

    def make_wrapper(original):
        def wrapper(*args, **kwargs):
            if not sink.here():
                return original(*args, **kwargs)
            if before is not None:
                before(args[0])
            token = steps.enter(name if isinstance(name, str) else name(args[0]), category)
            try:
                result = original(*args, **kwargs)
            finally:
                steps.exit(token)
            if after is not None:
                after(result)
            return result

        return wrapper

    return make_wrapper
