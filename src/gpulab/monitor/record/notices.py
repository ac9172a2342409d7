"""The small notices probes send one another through the sink: a fact one probe sees that others
need, delivered to whoever listens - never a look into another probe's state.

The memory window, say, must know the models the loop calls, the optimizers it steps and the
batches it fetches. The module hooks, the optimizer hooks and the DataLoader patches see those;
each sends a notice, and the memory window (and anyone else) listens. A probe that nobody listens
to costs a loop over an empty list.

Each notice, with what it carries, and who sends it:
"""

from __future__ import annotations

from collections.abc import Callable

MODULE_CALLED = "module called"
"""(module, args): an outermost module call starts, outside a DataLoader fetch (modules)."""
FETCH_MODULE_ENTERED = "fetch module entered"
"""(module,): a module is called inside a DataLoader fetch, while fetch modules are wanted (modules)."""
FETCH_MODULE_EXITED = "fetch module exited"
"""(): that module call returned (modules)."""
FETCH_MODULES_WANTED = "fetch modules wanted"
"""(wanted,): whether module calls inside a fetch should be seen from now on; the module hooks stay
paused in fetches until someone wants them (transforms, in their windows)."""
BATCH_FETCHED = "batch fetched"
"""(batch,): next() on a DataLoader returned a batch (loaders)."""
BACKWARD_ENDING = "backward ending"
"""(): a top-level backward() or autograd.grad is about to return (autograd)."""
OPTIMIZER_STEPPED = "optimizer stepped"
"""(optimizer,): an optimizer's step() returned, before the step accounting hears of it (autograd)."""
COMPILED = "compiled"
"""(): torch.compile finished a compile in this process (compile)."""
RANK_KNOWN = "rank known"
"""(rank,): torch.distributed's default group is up (distributed)."""
PROGRESS = "progress"
"""(): a collective or an outermost module call finished: the job is not hung (modules, distributed)."""
STEP_ENDED = "step ended"
"""(steps_done,): a step ended; sent by the recorder before the measurement windows take their turn."""
FORKED = "forked"
"""(): in a child forked from the recorded process (processes)."""
PROCESS_ENDING = "process ending"
"""(): a multiprocessing child is about to leave with os._exit, skipping atexit (processes)."""
EXCEPTION = "exception"
"""(error, traceback): the exception that ends the script (processes, attach.py, the session)."""


class Notices:
    """Listeners per notice. `sender(notice)` gives a hot path its own send function (no lookup
    per call); it sees listeners added later too."""

    def __init__(self):
        self._listeners: dict[str, list[Callable]] = {}

    def listen(self, notice: str, listener: Callable) -> Callable[[], None]:
        """Call `listener(*what the notice carries)` on each `notice`; returns the undo."""
        listeners = self._listeners.setdefault(notice, [])
        listeners.append(listener)

        def stop_listening() -> None:
            if listener in listeners:
                listeners.remove(listener)

        return stop_listening

    def send(self, notice: str, *args) -> None:
        for listener in self._listeners.get(notice, ()):
            listener(*args)

    def sender(self, notice: str) -> Callable[..., None]:
        listeners = self._listeners.setdefault(notice, [])

        def send(*args) -> None:
            for listener in listeners:
                listener(*args)

        return send
