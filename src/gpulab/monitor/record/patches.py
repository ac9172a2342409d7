"""How a probe changes PyTorch and Python while it records, and takes every change out again.

Each probe holds one `Patches`: its patches and hooks, undone in reverse order. PyTorch's own
hooks where they exist, a patch where none does (docs/profiling.md lists them, and why). Every
patch keeps the signature, name and docstring of what it replaces (`inspect.signature` follows
`__wrapped__`): Lightning re-creates a DataLoader from the parameters of `DataLoader.__init__`.

Invisible to torch.compile: while it compiles, the patches are out (`lift`, `relink`), so dynamo
traces torch's own functions. After a graph break, dynamo compiles each Python frame called
eagerly as a frame of its own - a hook's or a wrapper's too, frames the script does not have; so
the recorder's code, and all it calls, is marked for dynamo to run uncompiled
(`mark_recorder_frames`), but for a wrapper's call of torch's original.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from functools import update_wrapper
from types import CodeType, FunctionType, ModuleType

_in_place = 0  # patches in place in this process, every Patches together
_patched: list[tuple[object, str, object, object]] = []  # (owner, name, original, wrapper), all of them
_lifted = 0  # compiles under way (they nest): the originals are in place meanwhile


def installed() -> bool:
    """Is any of gpulab's patches in place in this process (a recorder's, while it records)?"""
    return _in_place > 0


class Patches:
    """The patches and hooks of one probe, and how to undo each."""

    def __init__(self):
        self._undo: list = []

    def patch(self, owner, name: str, make_wrapper) -> None:
        """Replace owner.name by make_wrapper(original) until undo()."""
        global _in_place
        had_own = name in vars(owner)
        original = getattr(owner, name)
        wrapper = update_wrapper(make_wrapper(original), original)
        entry = (owner, name, original, wrapper)
        _patched.append(entry)
        if not _lifted:
            setattr(owner, name, wrapper)
        _in_place += 1

        def undo():
            global _in_place
            _patched.remove(entry)
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
            _in_place -= 1

        self._undo.append(undo)

    def on_undo(self, undo) -> None:
        self._undo.append(undo)

    def filter_warnings(self, action: str, message: str) -> None:
        """warnings.filterwarnings(action, message=message) until undo()."""
        warnings.filterwarnings(action, message=message)
        added = warnings.filters[0]

        def undo():
            if added in warnings.filters:
                warnings.filters.remove(added)
                warnings._filters_mutated()

        self._undo.append(undo)

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


RECORDER_CODE = ("gpulab.monitor", "gpulab.memory", "gpulab.compiler")
"""The modules whose code runs while the recorder records: theirs are never frames to compile."""
_marked: set[str] = set()  # recorder modules whose code dynamo has been told to leave alone
_leave_uncompiled: Callable[..., None] | None = None


def mark_recorder_frames(leave_uncompiled: Callable[..., None] | None = None) -> None:
    """Have dynamo run every frame of the recorder's own code, and what it calls, uncompiled - but
    for a patch's wrapper, whose call of torch's original dynamo treats as without it.
    `leave_uncompiled(code)`: gpulab.compiler's, given by the compile probe once torch._dynamo is
    imported (nothing compiles before). Modules imported since are marked on the next call."""
    global _leave_uncompiled
    _leave_uncompiled = leave_uncompiled or _leave_uncompiled
    if _leave_uncompiled is None:
        return
    for name, module in list(sys.modules.items()):
        if name in _marked or module is None or not name.startswith(RECORDER_CODE):
            continue
        _marked.add(name)
        for code in _code_of(module):
            _leave_uncompiled(code)
    for _, _, _, wrapper in _patched:  # what a wrapper calls of torch's is compiled as without it
        _leave_uncompiled(wrapper.__code__, callees=False)


def _code_of(module: ModuleType) -> list[CodeType]:
    """Every code object of a module's functions and classes, nested ones (closures, lambdas) included."""
    functions = []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, type):
            for member in vars(obj).values():
                member = getattr(member, "__func__", member)  # staticmethod, classmethod
                if isinstance(member, property):
                    functions += [f for f in (member.fget, member.fset, member.fdel) if f is not None]
                elif isinstance(member, FunctionType):
                    functions.append(member)
        elif isinstance(obj, FunctionType):
            functions.append(obj)
    codes, stack = [], [f.__code__ for f in functions]
    while stack:
        code = stack.pop()
        codes.append(code)
        stack += [c for c in code.co_consts if isinstance(c, CodeType)]
    return codes


def lift() -> None:
    """A compile starts: torch's originals back in place (nested compiles: the outermost)."""
    global _lifted
    mark_recorder_frames()  # a recorder module imported since (a measurement window's)
    _lifted += 1
    if _lifted == 1:
        for owner, name, original, _ in _patched:
            setattr(owner, name, original)


def relink() -> None:
    """A compile ended: the wrappers back, once the outermost compile has ended."""
    global _lifted
    _lifted = max(0, _lifted - 1)
    if _lifted == 0:
        for owner, name, _, wrapper in _patched:
            setattr(owner, name, wrapper)
