"""The memory window: one step after warm-up (and after the kernel window) measured for memory
by gpulab.memory.step - the peak and what it is made of - emitted as one "memory" record.

Two steps: the one before is where torch's autograd profiler starts (it reports a free only for a block it
saw allocated), the second is measured. Both are marked profiled, so their time is left out of
the statistics, as the kernel window's are. What the step holds is found from what the recorder
already sees: the outermost modules the loop calls, the optimizers it steps, and the batch (the
DataLoader's, else the tensors passed to the outermost module).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from gpulab.memory.step import StepMemoryProbe
from gpulab.monitor.events import MemoryRecord


class Seen:
    """Objects seen, held weakly; noting one already seen costs a dict lookup (it is done on every
    outermost module call and every optimizer step, where a WeakSet would make a weakref each time)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, obj) -> None:
        ref = self._refs.get(id(obj))
        if ref is None or ref() is not obj:
            self._refs[id(obj)] = weakref.ref(obj)

    def __iter__(self):
        return iter([obj for obj in (ref() for ref in list(self._refs.values())) if obj is not None])


class MemoryWindow:
    def __init__(self, emit: Callable[[dict], None], enabled: bool, compiling: Callable[[], bool] = lambda: False):
        """`compiling()`: has the process compiled code (torch.compile)? Then the window adds no
        global module hooks (StepMemoryProbe.begin: per_module), on which compiled code guards."""
        self._emit = emit
        self._compiling = compiling
        self.done = not enabled
        self.models = Seen()  # outermost modules called (also for reading an out-of-memory error)
        self.optimizers = Seen()  # optimizers stepped
        self._probe: StepMemoryProbe | None = None
        self._measuring = False
        self._step = 0

    @property
    def active(self) -> bool:
        """Inside one of the window's two steps."""
        return self._probe is not None

    @property
    def measuring(self) -> bool:
        """Inside the measured step (the batch is noted)."""
        return self._measuring

    def on_step_end(self, steps_done: int, may_start: bool) -> None:
        """Between two steps: start the window (when `may_start`), measure, or finish it."""
        if self.done:
            return
        try:
            if self._probe is None:
                if may_start:
                    self._probe = StepMemoryProbe(self._device())
                    self._probe.prepare()
            elif not self._measuring:
                self._probe.begin(list(self.models), list(self.optimizers), per_module=not self._compiling())
                self._measuring, self._step = True, steps_done
            else:
                record: MemoryRecord = {"type": "memory", "step": self._step, **self._probe.end()}
                self._finish()
                self._emit(record)
        except Exception as e:  # another profiler running, an unusual tensor type: no memory figures
            self._give_up(e)

    def note_inputs(self, batch) -> None:
        if self._measuring:
            self._probe.note_inputs(batch)

    def finish(self) -> None:
        """The run ends: a window still open leaves a record saying so (and no hooks)."""
        if self._probe is not None:
            self._probe.close()
            self._finish()
            failed: MemoryRecord = {"type": "memory", "error": "the run ended during the memory window"}
            self._emit(failed)

    def _finish(self) -> None:
        self._probe, self._measuring, self.done = None, False, True

    def _give_up(self, error: Exception) -> None:
        if self._probe is not None:
            self._probe.close()
        self._finish()
        failed: MemoryRecord = {"type": "memory", "error": f"{type(error).__name__}: {error}"}
        self._emit(failed)

    def _device(self) -> torch.device:
        """Where the step's model lives: the first parameter of a module called, else of an optimizer."""
        for module in list(self.models):
            for p in module.parameters():
                return p.device
        for opt in list(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    return p.device
        return torch.device("cpu")
