"""What every probe is: one recorded concern that puts its own hooks and patches in, writes only
through the sink (sink.py), learns what other probes see only from notices (notices.py), and takes
its hooks out again.

The recorder calls, on each of its probes in turn:

    install(sink)      hooks and patches in (hook() does the probe's own), through self.patches
    after_fork()       in any forked child, a DataLoader worker too: drop what stayed in the
                       parent (a timer, a thread, a call that was open)
    new_lane()         in a forked child that records as its own lane: tally again from zero
    finish()           the run ends, hooks still in: close what is open, write the last records
    remove()           every hook and patch out, in reverse order
    snapshots()        whole-run tallies, as records (also read from the writer's thread: they
                       may not call into torch's running parts)
    facts()            fields of the "facts" snapshot
    end_fields()       fields of the "end" record

A WindowProbe also measures in a window of steps after warm-up (windows.py: they take turns).
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
        """Listen to `notice` (one of the sink's notices) until the probe is removed."""
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
    """A probe that measures in a window of steps (left out of the statistics)."""

    @property
    def active(self) -> bool:
        """Is the next step inside this window?"""
        return False

    @property
    def finished(self) -> bool:
        """Done for good in this lane: nothing left to open, measure or close."""
        return False

    @property
    def holds_back_later_windows(self) -> bool:
        """May a later window not open now (this one is open, or about to)?"""
        return self.active

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        """Between two steps: open (when `may_open`), measure, or close."""


def timed(sink: Sink, category: str, name, before=None, after=None):
    """A make_wrapper for Patches.patch: the original call, timed as a `category` span in the
    recorded thread. `name`: the span's name, or a function of the call's first argument that
    gives it; `before(first argument)`: what the probe notes first (a step that ended, a
    DataLoader it has not seen); `after(result)`: what it notes of the result (a batch)."""
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
