"""How a probe changes PyTorch and Python while it records, and takes every change out again.

Each probe holds one `Patches`: the patches and hooks it put in, undone in reverse order when
the probe is removed. PyTorch's own hooks where they exist (their handles' remove() goes in as an
undo), a patch where none does; docs/profiling.md lists them all, with the torch version they
were checked against (2.13.0), and why each patch is one.

Every patch keeps the signature, name and docstring of what it replaces (functools.update_wrapper:
`inspect.signature` follows `__wrapped__`), so frameworks that introspect them work: Lightning
re-creates a DataLoader from the parameters of `DataLoader.__init__`.
"""

from __future__ import annotations

import warnings
from functools import update_wrapper

_MARK = "__gpulab_patch__"
_in_place = 0  # patches in place in this process, every Patches together


def installed() -> bool:
    """Is any of gpulab's patches in place in this process (a recorder's, while it records)?"""
    return _in_place > 0


class Patches:
    """The patches and hooks of one probe, and how to undo each."""

    def __init__(self):
        self._undo: list = []

    def patch(self, owner, name: str, make_wrapper) -> None:
        """Replace owner.name by make_wrapper(original) until undo(); the wrapper takes the
        original's signature, name and docstring."""
        global _in_place
        had_own = name in vars(owner)
        original = getattr(owner, name)
        wrapper = update_wrapper(make_wrapper(original), original)
        setattr(wrapper, _MARK, True)
        setattr(owner, name, wrapper)
        _in_place += 1

        def undo():
            global _in_place
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
            _in_place -= 1

        self._undo.append(undo)

    def on_undo(self, undo) -> None:
        self._undo.append(undo)

    def ignore_warning(self, message: str) -> None:
        """Hide a warning that gpulab's own hooks cause (`message`: a regex of its start)."""
        warnings.filterwarnings("ignore", message=message)
        added = warnings.filters[0]

        def undo():
            if added in warnings.filters:
                warnings.filters.remove(added)
                warnings._filters_mutated()

        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
