"""What tensors hold, counted once per storage: views of one storage (a weight and its
transpose, a batch and its slices) share their bytes, so every sum here is over unique storages.

Read only what is safe to read (anything more has crashed CUDA jobs under the profiler): a tensor's data
address, offset, sizes and strides - plain integers - and nothing that changes the tensor's
life. No `untyped_storage()` (it leaves a Python object attached to the storage until the storage
dies, which torch >= 2.10 then has to keep in step from every thread that touches the storage),
no weak references or finalizers on tensors, and no tensor whose data is not its own: a subclass
with its own `__torch_dispatch__` (FakeTensor under torch.compile, FunctionalTensor, wrapper
subclasses) has no real storage, and asking for its address warns or worse.
"""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterable
from inspect import CO_OPTIMIZED

import torch

# Tensor types whose data is a real storage: torch.Tensor and subclasses that do not redirect
# dispatch (nn.Parameter, a user's plain subclass).
_PLAIN_DISPATCH = torch.Tensor.__torch_dispatch__


def local(t: torch.Tensor) -> torch.Tensor:
    """What this process holds of `t`: a DTensor's (FSDP's sharded parameters, their gradients and
    optimizer state) local shard, else the tensor itself. No DTensor exists unless its module was
    imported, so it is looked up, not imported (that takes ~0.5 s)."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def has_own_storage(t: torch.Tensor) -> bool:
    """A dense tensor backed by real memory (not meta, sparse, nested or a dispatch subclass)."""
    return (getattr(type(t), "__torch_dispatch__", None) is _PLAIN_DISPATCH and t.layout == torch.strided
            and not t.is_meta and not t.is_nested)


def storage_span(t: torch.Tensor) -> tuple[tuple[str, int], int] | None:
    """((device, address of the storage's first byte), bytes from there to the tensor's last
    element), or None for a tensor without data of its own (or with none left: FSDP frees a
    unit's gathered parameters by resizing their storage to nothing, address 0). For a tensor
    that covers its storage - what an op returns, a parameter - the bytes are the storage's; a
    slice reaches only part of it, and the largest span seen for a storage is its size here."""
    t = local(t)
    if not has_own_storage(t):
        return None
    ptr = t.data_ptr()
    if not ptr:
        return None
    itemsize = t.element_size()
    base = ptr - t.storage_offset() * itemsize
    if t.numel() == 0:
        return (str(t.device), base), 0
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1)
    return (str(t.device), base), (last + 1) * itemsize


def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    span = storage_span(t)
    return span[0] if span else None


def tensors_in(obj, depth: int = 0) -> Iterable[torch.Tensor]:
    """The tensors in a (nested) batch: a tensor, or lists, tuples and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from tensors_in(item, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for item in obj.values():
            yield from tensors_in(item, depth + 1)


class Storages:
    """A set of storages on one device and their bytes; adding a storage twice counts it once
    (a wider view of it raises its size to what that view reaches)."""

    def __init__(self, device: torch.device):
        self.device = str(device)
        self.bytes_by_key: dict[tuple[str, int], int] = {}

    def add(self, t: torch.Tensor) -> int:
        """Add `t`'s storage; the bytes it added (0 when known already, or on another device)."""
        span = storage_span(t)
        if span is None or span[0][0] != self.device:
            return 0
        key, nbytes = span
        known = self.bytes_by_key.get(key, 0)
        if nbytes <= known:
            return 0
        self.bytes_by_key[key] = nbytes
        return nbytes - known

    def add_all(self, tensors: Iterable[torch.Tensor]) -> "Storages":
        for t in tensors:
            self.add(t)
        return self

    def __contains__(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self.bytes_by_key

    @property
    def nbytes(self) -> int:
        return sum(self.bytes_by_key.values())


def parameters_and_buffers(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for t in (*m.parameters(), *m.buffers())]


def gradients(modules: Iterable[torch.nn.Module], optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    params = [p for m in modules for p in m.parameters()]
    params += [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    return [p.grad for p in params if p.grad is not None]


def optimizer_state(optimizers: Iterable[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every tensor an optimizer keeps per parameter (momentum, Adam's two moments, step counts)."""
    return [v for opt in optimizers for state in opt.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


# ----------------------------------------------------------------------------- what the script reaches

MAX_OBJECTS = 300_000  # a walk visits at most this many objects (~0.2 s); a bigger world is cut short

# Not walked into: what leads from the script's objects to the whole interpreter (modules,
# classes, functions and their globals, frames), and what holds no tensor.
_OPAQUE = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.CodeType, types.FrameType, types.GeneratorType, types.CoroutineType, types.AsyncGeneratorType,
           str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)


def script_roots(frame: types.FrameType | None) -> list:
    """Where the script's objects hang from, seen from `frame` up: every frame's local variables,
    and the module globals of frames outside the standard library and installed packages (the
    script's own files: a script that trains at module level keeps its model and data there)."""
    roots: list = []
    while frame is not None:
        roots.append(frame_locals(frame))
        if _is_script_file(frame.f_code.co_filename):
            roots.append(frame.f_globals)
        frame = frame.f_back
    return roots


def frame_locals(frame: types.FrameType) -> dict:
    """A frame's local variables, read without keeping them alive. Before Python 3.13, reading a
    function frame's `f_locals` leaves a snapshot of them on the frame, which holds each value
    until the frame reads them again or returns: the batch the loop has since replaced, a tensor
    the script deleted. The snapshot is emptied again when nothing else holds it (a function's
    own `locals()` is that same dict; then it stays); the next reader fills it afresh."""
    snapshot = frame.f_locals
    values = dict(snapshot)
    # 3: the frame's reference, `snapshot` and getrefcount's argument. From 3.13 f_locals is a
    # view that writes through to the frame, and keeps nothing.
    if type(snapshot) is dict and frame.f_code.co_flags & CO_OPTIMIZED and sys.getrefcount(snapshot) <= 3:
        snapshot.clear()
    return values


def _is_script_file(filename: str) -> bool:
    return not filename.startswith("<") and "site-packages" not in filename and not filename.startswith(sys.prefix)


def reachable_from(roots: list, device: torch.device, max_objects: int = MAX_OBJECTS) -> Storages:
    """Every storage on `device` that the objects in `roots` reach, through containers and object
    attributes (gc.get_referents: what the collector itself follows), up to `max_objects`.

    On a CPU, where torch keeps no count of its allocations, this is what a step starts with: the
    model, the optimizer's state, a dataset in memory, outputs the script keeps. A tensor only C++
    holds (a saved tensor of a graph the script kept) is not found. The walk starts from live
    frames, so it meets only objects that are fully built, unlike a scan of gc.get_objects(),
    which also returns objects another thread is still building and tensors of any kind."""
    found = Storages(device)
    seen: set[int] = set()
    todo = list(roots)
    while todo and len(seen) < max_objects:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kind = type(obj)  # type(), not isinstance(): isinstance reads __class__, which a proxy may compute
        if issubclass(kind, torch.Tensor):
            found.add(obj)
            grad = obj.grad if kind is torch.nn.Parameter else None
            if grad is not None:
                todo.append(grad)
        elif not issubclass(kind, _OPAQUE):
            todo.extend(gc.get_referents(obj))
    return found
