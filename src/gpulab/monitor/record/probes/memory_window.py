"""The memory window probe: one step after warm-up (and after the kernel window) measured by
gpulab.memory.step - the peak and what it is made of - as one "memory" record; and, when the
script runs out of memory, what was in use and where ("oom", gpulab.memory.oom).

The window is two steps, both left out of the statistics: torch's autograd profiler starts in the
first (it reports a free only for a block it saw allocated), the second is measured. What the
step holds comes from the other probes' notices: the outermost modules called, the optimizers
stepped, the batch (the DataLoader's, else the tensors passed to the outermost module). After a
compile the window adds no global module hooks, on which compiled code guards.
"""

from __future__ import annotations

import weakref

import torch

from gpulab.memory.oom import is_out_of_memory, read_out_of_memory
from gpulab.memory.step import StepMemoryProbe
from gpulab.monitor.events import MemoryRecord, OomRecord
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.probe import WindowProbe


class Seen:
    """Objects seen, held weakly; noting one already seen costs a dict lookup (on every outermost
    module call and optimizer step, where a WeakSet would make a weakref each time)."""

    def __init__(self):
        self._refs: dict[int, weakref.ref] = {}

    def add(self, obj) -> None:
        ref = self._refs.get(id(obj))
        if ref is None or ref() is not obj:
            self._refs[id(obj)] = weakref.ref(obj)

    def __iter__(self):
        return iter([obj for obj in (ref() for ref in list(self._refs.values())) if obj is not None])


class MemoryProbe(WindowProbe):
    """`enabled`: measure a step (--no-memory: not); `warmup_steps`: the window opens after them."""

    def __init__(self, enabled: bool, warmup_steps: int):
        self._enabled = enabled
        self._warmup_steps = warmup_steps
        self._compiled = False  # kept across a fork: the child runs its parent's compiled code
        self.new_lane()

    def hook(self) -> None:
        self.listen(self.sink.notices.module_called, self._module_called)
        self.listen(self.sink.notices.optimizer_stepped, lambda optimizer: self.optimizers.add(optimizer))
        self.listen(self.sink.notices.loader_iterated, self._loader_iterated)
        self.listen(self.sink.notices.batch_fetched, self._note_inputs)
        self.listen(self.sink.notices.compiled, self._compiled_code)
        self.listen(self.sink.notices.exception, self._out_of_memory)

    def new_lane(self) -> None:
        """What each process measures for itself (a forked lane starts again)."""
        self.done = not self._enabled
        self.models = Seen()  # outermost modules called (also for reading an out-of-memory error)
        self.optimizers = Seen()  # optimizers stepped
        self.iterators = Seen()  # DataLoader iterators: a for loop holds them out of its frame's locals
        self._probe: StepMemoryProbe | None = None
        self._measuring = False
        self._step = 0

    def _module_called(self, module, args) -> None:
        self.models.add(module)
        if self._measuring:
            self._probe.note_inputs(args)

    def _note_inputs(self, batch) -> None:
        if self._measuring:
            self._probe.note_inputs(batch)

    def _loader_iterated(self, iterator) -> None:
        if self.done:  # every epoch makes a new one: kept only while a window may still come
            return
        try:
            self.iterators.add(iterator)
        except TypeError:  # a subclass's iterator that takes no weak reference: its batches go uncounted
            pass

    def _compiled_code(self) -> None:
        self._compiled = True

    @property
    def active(self) -> bool:
        return self._probe is not None

    @property
    def finished(self) -> bool:
        return self.done

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        """Between two steps: start the window (after warm-up, when `may_open`), measure, or finish it."""
        if self.done:
            return
        try:
            if self._probe is None:
                if may_open and steps_done >= self._warmup_steps:
                    self._probe = StepMemoryProbe(self._device())
                    self._probe.prepare()
            elif not self._measuring:
                self._probe.begin(list(self.models), list(self.optimizers), per_module=not self._compiled,
                                  held=list(self.iterators))
                self._measuring, self._step = True, steps_done
            else:
                record: MemoryRecord = {"type": "memory", "step": self._step, **self._probe.end()}
                self._end(record)
        except Exception as e:  # another profiler running, an unusual tensor type: no memory figures
            self._end({"type": "memory", "error": f"{type(e).__name__}: {e}"})

    def finish(self) -> None:
        """The run ends: a window still open leaves a record saying so (and no hooks)."""
        if self._probe is not None:
            self._end({"type": "memory", "error": "the run ended during the memory window"})

    def _end(self, record: MemoryRecord) -> None:
        """The window is over, its hooks out whatever its state: `record` says how."""
        if self._probe is not None:
            self._probe.close()
        self._probe, self._measuring, self.done = None, False, True
        self.sink.emit(record)

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

    def _out_of_memory(self, error: BaseException, tb) -> None:
        """The exception that ends the script: out of memory, what was in use, and where, while the
        failing frames still hold it."""
        if not is_out_of_memory(error):
            return
        try:
            oom = read_out_of_memory(error, tb, list(self.models), list(self.optimizers), user_site)
            record: OomRecord = {"type": "oom", **oom}
        except Exception as e:  # reading it may need memory too: say so, never hide the script's own error
            record = {"type": "oom", "message": str(error).splitlines()[0], "phase": f"unknown ({type(e).__name__})",
                      "in_use": {}, "total_in_use": 0}
        self.sink.emit(record)
