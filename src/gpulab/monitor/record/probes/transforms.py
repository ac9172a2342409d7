"""The transforms probe: per-sample transforms inside a DataLoader fetch, each timed as its own
data-wait span, with the line that built or called it, so the report can rank them by cost.

It sees the modules called inside a fetch (torchvision's transforms are nn.Modules) from the
module probe's notices, which it asks for while it times them (fetch_modules_wanted); and patches
torchvision's Compose, once imported: its __init__ for where the transforms were built, and v1's
__call__ for a span per member (v1 members are plain callables; v2's are nn.Modules).

Timing them costs a few microseconds per sample and transform (the module hooks' slow path, a
clock read and a record per span), so they are timed only in the warm-up steps (are there any?)
and then, if there are, in a window of WINDOW_STEPS steps once the other windows are over; the
report ranks them from that window. In every other step the module hooks are paused in fetches.
"""

from __future__ import annotations

import sys

import torch

from gpulab.monitor.events import TRANSFORM_PREFIX
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.interpreter import after_import
from gpulab.monitor.record.probe import PhasedWindow

_MAX_DEPTH = 2  # a Compose and its members; deeper calls are part of their transform
WINDOW_STEPS = 3  # steps whose transforms are timed, after warm-up (~200 calls each at batch 64)


class TransformProbe(PhasedWindow):
    def __init__(self, warmup_steps: int):
        self._warmup_steps = warmup_steps
        self.calls: dict[str, dict] = {}  # "Normalize" -> {calls, where}
        self._built_at: dict[int, str] = {}  # id(transform) -> where the user built it
        self._open: list[int | None] = []  # the spans of the fetch modules inside their calls
        self._depth = 0
        self._phase = "warm-up"  # -> "waiting" (for the other windows) -> "window" -> "done"
        self._window_ends = 0

    def hook(self) -> None:
        for module, members_call in (("torchvision.transforms.transforms", True),
                                     ("torchvision.transforms.v2._container", False)):
            self.patches.on_undo(after_import(module, lambda m, c=members_call: self._patch_compose(m.Compose, c)))
        self.listen(self.sink.notices.fetch_module_entered, lambda module: self._open.append(self._begin(module)))
        self.listen(self.sink.notices.fetch_module_exited, self._module_exited)
        self.sink.notices.fetch_modules_wanted.send(self.timing)

    @property
    def timing(self) -> bool:
        """Are transforms timed in the current step?"""
        return self._phase in ("warm-up", "window")

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        """The window opens after warm-up, if it saw transforms, when no other window runs (`may_open`)."""
        timing = self.timing
        if self._phase == "warm-up" and steps_done >= self._warmup_steps:
            self._phase = "waiting" if self.calls else "done"
        if self._phase == "waiting" and may_open:
            self._phase, self._window_ends = "window", steps_done + WINDOW_STEPS
        elif self._phase == "window" and steps_done >= self._window_ends:
            self._phase = "done"
        if self.timing != timing:
            self.sink.notices.fetch_modules_wanted.send(self.timing)

    def new_lane(self) -> None:
        """A forked lane counts again, from its own warm-up; where transforms were built still holds."""
        self.calls = {}
        self._open.clear()
        self._depth = 0
        self._phase = "warm-up"
        self.sink.notices.fetch_modules_wanted.send(self.timing)

    def facts(self) -> dict:
        return {"transforms": self.calls}

    def _module_exited(self) -> None:
        token = self._open.pop() if self._open else None
        if token is not None:
            self._end(token)

    def _begin(self, transform) -> int | None:
        """A transform inside a fetch starts: its span (None: not timing now, or nested in another)."""
        if not self.timing or self._depth >= _MAX_DEPTH:
            return None
        name = type(transform).__name__
        entry = self.calls.get(name)
        if entry is None:
            where = self._built_at.get(id(transform)) or user_site(sys._getframe(1))
            entry = self.calls[name] = {"calls": 0, "where": where}
        entry["calls"] += 1
        self._depth += 1
        return self.sink.steps.enter(TRANSFORM_PREFIX + name, "data_wait")

    def _end(self, token: int) -> None:
        self.sink.steps.exit(token)
        self._depth -= 1

    def _call(self, transform, img):
        """transform(img) as its span (a transform that is no nn.Module)."""
        token = self._begin(transform)
        if token is None:
            return transform(img)
        try:
            return transform(img)
        finally:
            self._end(token)

    def _patch_compose(self, compose, members_call: bool) -> None:
        """torchvision's Compose: note where each transform was built; `members_call` (v1): time
        each member as its own span."""
        sink, built_at = self.sink, self._built_at

        def wrap_init(original):
            def __init__(composed, transforms, *args, **kwargs):
                where = user_site(sys._getframe(1))
                for t in transforms:
                    built_at.setdefault(id(t), where)
                return original(composed, transforms, *args, **kwargs)
            return __init__

        def wrap_call(original):
            def __call__(composed, img):
                if not (self.timing and sink.here() and sink.steps.loading_data()):
                    return original(composed, img)
                for t in composed.transforms:  # what Compose.__call__ does, one span per member
                    img = t(img) if isinstance(t, torch.nn.Module) else self._call(t, img)
                return img
            return __call__

        self.patches.patch(compose, "__init__", wrap_init)
        if members_call:
            self.patches.patch(compose, "__call__", wrap_call)
