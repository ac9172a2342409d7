"""Where each moment of the recorded thread goes, and where one training step ends.

Time is charged, at every transition, to the category of the span on top of the stack, "other"
when none is open: a sync inside a forward counts as sync, not compute. Categories
(events.CATEGORIES): data_wait (inside a DataLoader's iter() or fetch, transforms and collate
included), h2d (a batch copied to the device), compute (a module's forward, backward, an
optimizer's step or zero_grad), collective (torch.distributed, DDP's allreduce wait), sync (a host
sync on CUDA), compile, other (the user's Python, torch ops outside any module).

Steps, by the strongest rule seen (docs/profiling.md, Steps): explicit (`p.step()`) > optimizer
(the first optimizer to step) > backward (a top-level backward ends a step when the loop comes
back for data or a forward, so a manual update after it belongs to its step). Steps ended by a
weaker rule before a stronger one shows up are folded into the first step of the stronger one.
"""

from __future__ import annotations

import time
import weakref
from collections import Counter
from collections.abc import Callable

from gpulab.monitor.events import CATEGORIES, TRANSFORM_PREFIX, StepRecord

_MAX_DATA_SPANS_PER_STEP = 64
_RULE_STRENGTH = {None: 0, "backward": 1, "optimizer": 2, "explicit": 3}


class StepAccounting:
    """`after_step(steps_done)`: the recorder's work between two steps, whose time belongs to
    neither; it says whether the next step runs inside a measurement window."""

    def __init__(self, trace_steps: int, emit: Callable[[dict], None], after_step: Callable[[int], bool]):
        self.trace_steps = trace_steps
        self._emit = emit
        self._after_step = after_step
        self.new_lane()

    def new_lane(self) -> None:
        """Everything from scratch: at the start, and in place in a forked child's own lane."""
        self._stack: list[tuple[str, str, float]] = []  # (name, category, t0)
        self._t_last: float | None = None  # charged up to here; None before the first event
        self.index = 0  # steps done
        self._step_t0: float | None = None
        self._new_step_state(profiled=False)
        self.rule: str | None = None  # "explicit", "optimizer" or "backward"
        self._backward_since_step = 0
        self.backward_calls = 0
        self.optimizer_steps = 0
        self.span_seconds: Counter = Counter()  # whole run, per span name
        self._primary_optimizer = None  # weakref to the optimizer whose step ends a training step

    # ------------------------------------------------------------------ spans

    def charged_category(self) -> str | None:
        """The category charged now, for the stack sampler: None before anything was charged, or
        when the stack changed while it was read (from another thread)."""
        if self._t_last is None:
            return None
        try:
            stack = self._stack
            return stack[-1][1] if stack else "other"
        except IndexError:
            return None

    def loading_data(self) -> bool:
        """Is the recorded thread inside a DataLoader fetch?"""
        stack = self._stack
        return bool(stack) and stack[-1][1] == "data_wait"

    def enter(self, name: str, category: str) -> int:
        now = time.perf_counter()
        if self._t_last is None:
            self._begin(now)
        else:
            self._charge(now)
        self._stack.append((name, category, now))
        return len(self._stack) - 1

    def exit(self, token: int) -> None:
        """Close the span `token` (and any span left open above it, e.g. by an exception)."""
        now = time.perf_counter()
        self._charge(now)
        while len(self._stack) > token:
            name, category, t0 = self._stack.pop()
            self._close_span(name, category, t0, now)

    def add_closed_span(self, name: str, category: str, t0: float, t1: float) -> None:
        """Charge [t0, t1] to `category`: a call classified only after it returned (a sync)."""
        if self._t_last is None:
            self._begin(t0)
        t0 = max(t0, self._t_last)
        self._charge(t0)
        self._acc[category] += t1 - t0
        self._t_last = t1
        self._close_span(name, category, t0, t1)

    def count(self, key: str, n: float = 1) -> None:
        """Add to this step's count `key` (syncs, copies, their bytes)."""
        self._counts[key] += n

    def _begin(self, now: float) -> None:
        self._t_last = self._step_t0 = now

    def _charge(self, now: float) -> None:
        if self._stack:
            name, category, _ = self._stack[-1]
            if category == "data_wait" and name.startswith(TRANSFORM_PREFIX):
                self._counts[name] += now - self._t_last  # "transform: Normalize": seconds this step
        else:
            category = "other"
        self._acc[category] += now - self._t_last
        self._t_last = now

    def _close_span(self, name: str, category: str, t0: float, t1: float) -> None:
        self.span_seconds[name] += t1 - t0
        if self.index < self.trace_steps:
            self._spans.append([name, category, t0, t1])
        # A transform runs inside its fetch: the fetch is the data wait the timeline draws.
        if (category == "data_wait" and not name.startswith(TRANSFORM_PREFIX)
                and len(self._data_spans) < _MAX_DATA_SPANS_PER_STEP):
            self._data_spans.append([t0, t1])

    # ------------------------------------------------------------------ steps

    def mark_step(self) -> None:
        """An explicit step boundary (`p.step()`); from then on nothing else marks steps."""
        self._use_rule("explicit")
        self.end_step()

    def backward_done(self) -> None:
        self._backward_since_step += 1
        self.backward_calls += 1

    def end_step_after_backward(self) -> None:
        """Backward rule: the loop came back for data or a forward after a backward: a step ended."""
        if self._backward_since_step and self.rule in (None, "backward"):
            self._use_rule("backward")
            self.end_step()

    def optimizer_stepped(self, optimizer) -> None:
        """Optimizer rule: with several optimizers (a GAN, gpulab's per-replica ones) the first to
        step marks the training step; once it is garbage-collected, the next one."""
        self.optimizer_steps += 1
        if not self._use_rule("optimizer"):
            return
        primary = self._primary_optimizer() if self._primary_optimizer is not None else None
        if primary is None:
            self._primary_optimizer = weakref.ref(optimizer)
            primary = optimizer
        if optimizer is primary:
            self.end_step()

    def _use_rule(self, rule: str) -> bool:
        """Switch to `rule` if it is stronger than the current one; False if a stronger one rules."""
        current = self.rule
        if _RULE_STRENGTH[rule] < _RULE_STRENGTH[current]:
            return False
        if rule != current:
            if self.index > 0:
                # Steps ended by the weaker rule belong to the first step of this one; the reader
                # (events.Recording) merges them, since some may already be in the file.
                self._emit({"type": "fold"})
                self.index = 0
            self.rule = rule
            self._emit({"type": "rule", "rule": rule})
        return True

    def end_step(self) -> None:
        now = time.perf_counter()
        if self._t_last is None:
            self._begin(now)
        self._charge(now)
        self._backward_since_step = 0
        record: StepRecord = {"type": "step", "i": self.index, "t0": self._step_t0, "t1": now, **self._step_fields()}
        if self.index < self.trace_steps:
            record["spans"] = self._spans
        self._emit(record)
        self.index += 1
        profiled = self._after_step(self.index)
        # Time spent in the recorder's own bookkeeping belongs to neither step.
        resume = time.perf_counter()
        self._new_step_state(profiled)
        self._step_t0 = self._t_last = resume

    def tail(self, now: float) -> StepRecord | None:
        """The time from the last step's end to `now`, as the run ends (None if nothing was recorded)."""
        if self._t_last is None:
            return None
        self._charge(now)
        return {"type": "tail", "t0": self._step_t0, "t1": now, **self._step_fields()}

    def _new_step_state(self, profiled: bool) -> None:
        self._acc = dict.fromkeys(CATEGORIES, 0.0)
        self._spans: list[list] = []
        self._data_spans: list[list] = []
        self._counts = Counter()
        self._profiled = profiled

    def _step_fields(self) -> dict:
        return {"excl": self._acc, "counts": dict(self._counts), "profiled": self._profiled, "data": self._data_spans}
