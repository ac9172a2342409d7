"""Per-sample transforms inside a DataLoader fetch, each timed as its own data-wait span so the
report can rank them by cost, with the line that built or called them."""

from __future__ import annotations

import sys

from gpulab.monitor.events import TRANSFORM_PREFIX
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.steps import StepAccounting

_MAX_DEPTH = 2  # a Compose and its members; deeper calls are part of their transform


class TransformSpans:
    def __init__(self, steps: StepAccounting):
        self.steps = steps
        self.calls: dict[str, dict] = {}  # "Normalize" -> {calls, where}
        self._depth = 0
        self._built_at: dict[int, str] = {}  # id(transform) -> where the user built it

    def reset(self, steps: StepAccounting) -> None:
        """A new lane (a forked child): count again, into its own steps; where transforms were
        built still holds."""
        self.steps = steps
        self.calls = {}
        self._depth = 0

    def begin(self, transform) -> int | None:
        """A transform inside a fetch starts: its own span (None: nested too deep, part of its
        parent's span)."""
        if self._depth >= _MAX_DEPTH:
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
