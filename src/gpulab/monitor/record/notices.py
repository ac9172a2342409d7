"""What probes tell one another through the sink: a fact one probe sees that others need
(the memory window must know the models the loop calls, which the module hooks see), delivered
to whoever listens - never a look into another probe's state. Each notice is a field of Notices,
held by reference (`notices.step_ended.send`), so a hot path binds its send once and a misspelt
notice fails at once; one nobody listens to costs a loop over an empty list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


class Notice:
    """One notice's listeners, called in the order they listened."""

    def __init__(self):
        self._listeners: list[Callable] = []

    def listen(self, listener: Callable) -> Callable[[], None]:
        """Call `listener(*what the notice carries)` on each send; returns the undo."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def send(self, *args) -> None:
        for listener in self._listeners:
            listener(*args)


def _notice():
    return field(default_factory=Notice)  # each recording its own listeners


@dataclass
class Notices:
    """Each notice, with what it carries (the arguments of send) and who sends it."""

    module_called: Notice = _notice()
    """(module, args): an outermost module call starts, outside a DataLoader fetch (modules)."""
    fetch_module_entered: Notice = _notice()
    """(module,): a module is called inside a DataLoader fetch, while fetch modules are wanted (modules)."""
    fetch_module_exited: Notice = _notice()
    """(): that module call returned (modules)."""
    fetch_modules_wanted: Notice = _notice()
    """(wanted,): whether module calls inside a fetch should be seen from now on; the module hooks
    stay paused in fetches until someone wants them (transforms, in their windows)."""
    loader_iterated: Notice = _notice()
    """(iterator,): iter() on a DataLoader returned a new pass's iterator, in any thread (loaders)."""
    batch_fetched: Notice = _notice()
    """(batch,): next() on a DataLoader returned a batch (loaders)."""
    backward_ending: Notice = _notice()
    """(): a top-level backward() or autograd.grad is about to return (autograd)."""
    optimizer_stepped: Notice = _notice()
    """(optimizer,): an optimizer's step() returned, before the step accounting hears of it (autograd)."""
    compiled: Notice = _notice()
    """(): torch.compile finished a compile in this process (compile)."""
    rank_known: Notice = _notice()
    """(rank,): torch.distributed's default group is up (distributed)."""
    progress: Notice = _notice()
    """(): a collective or an outermost module call finished: the job is not hung (modules, distributed)."""
    step_ended: Notice = _notice()
    """(steps_done,): a step ended; sent by the recorder before the measurement windows take their turn."""
    forked: Notice = _notice()
    """(): in a child forked from the recorded process (processes)."""
    process_ending: Notice = _notice()
    """(): a multiprocessing child is about to leave with os._exit, skipping atexit (processes)."""
    exception: Notice = _notice()
    """(error, traceback): the exception that ends the script (processes, attach.py, the session)."""
