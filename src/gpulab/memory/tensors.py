"""What tensors hold, counted once per storage: views of one storage (a weight and its
transpose, a batch and its slices) share their bytes, so every sum here is over unique storages."""

from __future__ import annotations

import gc
from collections.abc import Iterable

import torch

def storage_key(t: torch.Tensor) -> tuple[str, int] | None:
    """(device, address) of a tensor's storage, or None for tensors without one (meta, sparse)."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    ptr = storage.data_ptr()
    return (str(t.device), ptr) if ptr else None


def storage_nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return 0


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
    """A set of storages on one device and their bytes; adding a storage twice counts it once."""

    def __init__(self, device: torch.device):
        self.device = str(device)
        self.bytes_by_key: dict[tuple[str, int], int] = {}

    def add(self, t: torch.Tensor) -> int:
        """Add `t`'s storage; the bytes it added (0 when known already, or on another device)."""
        key = storage_key(t)
        if key is None or key[0] != self.device or key in self.bytes_by_key:
            return 0
        nbytes = storage_nbytes(t)
        self.bytes_by_key[key] = nbytes
        return nbytes

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


def reachable_tensors(device: torch.device) -> Storages:
    """Every storage on `device` that a Python object reaches: on a CPU, where torch keeps no
    count of its allocations, what is live at a step boundary (a tensor only C++ holds - a saved
    tensor of a graph the script kept - is not found). One pass over the garbage collector's
    objects: ~0.25 s per million objects (43 ms over 172,000 measured here)."""
    found = Storages(device)
    for obj in gc.get_objects():
        # type(), not isinstance(): isinstance reads obj.__class__, which some lazy proxies resolve
        if issubclass(type(obj), torch.Tensor):
            found.add(obj)
    return found
