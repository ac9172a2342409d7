"""Per-sample transforms inside a DataLoader fetch, each timed as its own data-wait span so the
report can rank them by cost, with the line that built or called them.

Timing them costs: the module hooks that see them send every module call through torch's slow
path, and each span reads the clock and keeps a record - a few microseconds per sample and
transform, enough to move the data share of a loop of cheap transforms by 8 points (issue 28).
So they are timed only while `timing` is True: in the warm-up steps (are there any?) and then,
if there are, in a window of WINDOW_STEPS steps once the other measurement windows are over;
the window's steps are left out of the statistics like theirs, and the report ranks the
transforms from them. In every other step a fetch runs with the module hooks paused (patches.py):
a per-sample transform costs nothing.
"""

from __future__ import annotations

import sys

from gpulab.monitor.events import TRANSFORM_PREFIX
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.steps import StepAccounting

_MAX_DEPTH = 2  # a Compose and its members; deeper calls are part of their transform
WINDOW_STEPS = 3  # steps whose transforms are timed, after warm-up (~200 calls each at batch 64)


class TransformSpans:
    def __init__(self, steps: StepAccounting, warmup_steps: int):
        self.steps = steps
        self.calls: dict[str, dict] = {}  # "Normalize" -> {calls, where}
        self._depth = 0
        self._built_at: dict[int, str] = {}  # id(transform) -> where the user built it
        self._warmup_steps = warmup_steps
        self._phase = "warm-up"  # -> "waiting" (for the other windows) -> "window" -> "done"
        self._window_ends = 0

    @property
    def timing(self) -> bool:
        """Are transforms timed in the current step (the module hooks see them)?"""
        return self._phase in ("warm-up", "window")

    @property
    def window_active(self) -> bool:
        """Is the current step in the window (left out of the statistics)?"""
        return self._phase == "window"

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        """After `steps_done` steps: the window opens once warm-up is over, if the warm-up saw
        transforms, and when no other measurement window runs (`may_open`)."""
        if self._phase == "warm-up" and steps_done >= self._warmup_steps:
            self._phase = "waiting" if self.calls else "done"
        if self._phase == "waiting" and may_open:
            self._phase, self._window_ends = "window", steps_done + WINDOW_STEPS
        elif self._phase == "window" and steps_done >= self._window_ends:
            self._phase = "done"

    def reset(self, steps: StepAccounting) -> None:
        """A new lane (a forked child): count again, into its own steps, from its own warm-up;
        where transforms were built still holds."""
        self.steps = steps
        self.calls = {}
        self._depth = 0
        self._phase = "warm-up"

    def begin(self, transform) -> int | None:
        """A transform inside a fetch starts: its own span (None: not timing now, or nested too
        deep: part of its parent's span)."""
        if not self.timing or self._depth >= _MAX_DEPTH:
            return None
        name = type(transform).__name__
        entry = self.calls.get(name)
        if entry is None:
            where = self._built_at.get(id(transform)) or user_site(sys._getframe(1))
            entry = self.calls[name] = {"calls": 0, "where": where}
        entry["calls"] += 1
        self._depth += 1
        return self.steps.enter(TRANSFORM_PREFIX + name, "data_wait")

    def end(self, token: int) -> None:
        self.steps.exit(token)
        self._depth -= 1

    def call(self, transform, call, *args, **kwargs):
        """call(*args, **kwargs) as the span of `transform` (one that is no nn.Module)."""
        token = self.begin(transform)
        if token is None:
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        finally:
            self.end(token)

    def note_built(self, transforms, where: str | None) -> None:
        """Where the user built these transforms (a Compose of them)."""
        for t in transforms:
            self._built_at.setdefault(id(t), where)
