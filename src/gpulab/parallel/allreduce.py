"""Allreduce across the devices of one process: every tensor ends up holding the sum of all.

Three ways, as the textbook's exercise asks ("implement a more efficient allreduce"):

naive  add everything into device 0, then copy the sum back to each device. Device 0
       receives (k-1) full tensors and sends (k-1): its link is the bottleneck.
ring   split each tensor into k chunks; in k-1 reduce-scatter steps every device passes one
       chunk to its right neighbour, which adds it to its own, so device i ends up owning the
       full sum of chunk i+1; then k-1 all-gather steps pass the finished chunks around. Each
       device sends 2(k-1)/k of the data, independent of k, and every link is busy at once.
nccl   NVIDIA's collective library (torch.cuda.nccl), when every tensor is on its own GPU.

Many small gradients are flattened into a few large buckets first (`Buckets`): one large
transfer is far cheaper than many small ones. Across processes (torchrun), gpulab does not
move bytes itself: `torch.distributed.all_reduce` (gloo, NCCL) sums the same buckets.
"""

from __future__ import annotations

import typing
import weakref
from collections.abc import Callable
from contextlib import contextmanager

import torch

from gpulab.config import Allreduce
from gpulab.errors import UserError

ALGORITHMS = typing.get_args(Allreduce)


def _check(tensors: list[torch.Tensor]) -> None:
    if not tensors:
        raise UserError("allreduce got no tensors: pass one tensor per device")
    first = tensors[0]
    for i, t in enumerate(tensors[1:], start=1):
        if t.shape != first.shape or t.dtype != first.dtype:
            raise UserError(
                f"allreduce needs equal shapes and dtypes: tensor 0 is {tuple(first.shape)} {first.dtype}, "
                f"tensor {i} is {tuple(t.shape)} {t.dtype}"
            )


def nccl_usable(tensors: list[torch.Tensor]) -> bool:
    devices = [t.device for t in tensors]
    if not all(d.type == "cuda" for d in devices) or len(set(devices)) != len(devices):
        return False
    try:
        import torch.cuda.nccl as nccl

        return nccl.is_available(tensors)
    except (ImportError, RuntimeError):
        return False


NCCL_NEEDS = ("allreduce 'nccl' needs every tensor on its own CUDA GPU with NCCL available: use --allreduce ring or "
              "naive here")


def choose(tensors: list[torch.Tensor], algorithm: str = "auto") -> str:
    """The algorithm `auto` resolves to for these tensors (NCCL, else ring, else naive)."""
    if algorithm not in ALGORITHMS:
        raise UserError(f"unknown allreduce algorithm '{algorithm}': choose one of {', '.join(ALGORITHMS)}")
    if algorithm == "nccl" and len(tensors) > 1 and not nccl_usable(tensors):
        raise UserError(NCCL_NEEDS)
    if algorithm != "auto":
        return algorithm
    if len(tensors) > 1 and nccl_usable(tensors):
        return "nccl"
    if len({t.device for t in tensors}) == 1:
        # Virtual replicas share one memory: nothing crosses a link, so the fewest, largest
        # additions win, which is the naive scheme.
        return "naive"
    return "ring"


def allreduce(tensors: list[torch.Tensor], algorithm: str = "auto") -> str:
    """Sum `tensors` (one per device) in place; returns the algorithm used."""
    _check(tensors)
    algorithm = choose(tensors, algorithm)
    if len(tensors) == 1 or tensors[0].numel() == 0:
        return algorithm
    if algorithm == "naive":
        _naive(tensors)
    elif algorithm == "ring":
        _ring(tensors)
    else:
        if not nccl_usable(tensors):
            raise UserError(NCCL_NEEDS)
        import torch.cuda.nccl as nccl

        nccl.all_reduce(tensors)
    return algorithm


@torch.no_grad()
def _naive(tensors: list[torch.Tensor]) -> None:
    total = tensors[0]
    for t in tensors[1:]:
        total += t.to(total.device, non_blocking=True)
    for t in tensors[1:]:
        t.copy_(total, non_blocking=True)


@torch.no_grad()
def _ring(tensors: list[torch.Tensor]) -> None:
    k = len(tensors)
    # tensor_split handles numel < k (some chunks empty) and numel not divisible by k.
    chunks = [torch.tensor_split(t.view(-1), k) for t in tensors]
    # Reduce-scatter: at step s, device i sends chunk (i - s) to device i+1, which adds it.
    # Within one step every device sends a different chunk from the one it receives, so
    # issuing the k sends one after another is race-free.
    for s in range(k - 1):
        for i in range(k):
            c, dst = (i - s) % k, (i + 1) % k
            chunks[dst][c].add_(chunks[i][c].to(chunks[dst][c].device, non_blocking=True))
    # Device i now holds the full sum of chunk (i + 1). All-gather passes finished chunks on.
    for s in range(k - 1):
        for i in range(k):
            c, dst = (i + 1 - s) % k, (i + 1) % k
            chunks[dst][c].copy_(chunks[i][c], non_blocking=True)


def weak_hook(method, *args):
    """A hook (or listener) calling `method(*args, *hook_args)` without keeping its object alive.

    A parameter's hooks live as long as the parameter; a strong reference from them back to the
    object that owns the parameters (their `Buckets`, the strategy) would make a cycle that only
    the garbage collector frees, possibly at interpreter exit, taking a process group (and its
    threads) down with it then. The same holds for a listener that points back at its source."""
    ref = weakref.WeakMethod(method)

    def hook(*hook_args):
        bound = ref()
        if bound is not None:
            bound(*args, *hook_args)

    return hook


FIRST_BUCKET_BYTES = 2**20  # DDP's defaults: a small first bucket so communication starts early,
BUCKET_BYTES = 25 * 2**20   # then buckets large enough that per-message latency is amortized


def bucket_layout(params: list[torch.nn.Parameter], bucket_bytes: int, first_bucket_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, in reverse registration order: backward produces the last
    layer's gradients first, so bucket 0 fills first and can be sent while backward continues.
    A bucket holds one dtype; the first is capped at `first_bucket_bytes`, the rest at `bucket_bytes`."""
    groups: list[list[int]] = []
    size, dtype = 0, None
    for i in reversed(range(len(params))):
        p = params[i]
        nbytes = p.numel() * p.element_size()
        cap = first_bucket_bytes if len(groups) == 1 else bucket_bytes
        if not groups or p.dtype != dtype or (groups[-1] and size + nbytes > cap):
            groups.append([])
            size, dtype = 0, p.dtype
        groups[-1].append(i)
        size += nbytes
    return groups


ReadyListener = Callable[[int, int], None]
"""Called with (replica, bucket) when a bucket has all its gradients of this backward pass."""


class Buckets:
    """Gradients of one or more replicas, laid out as views into a few flat buffers per replica.

    Each replica's `.grad` tensors are views into flat buffers, so autograd accumulates straight
    into them and a collective runs on a handful of large tensors with no flatten/unflatten
    copies (the trick DDP uses). One layout serves every strategy: the k replicas of one process
    (`allreduce` below) and the one replica of each torchrun rank (`GradSync`).

    Only parameters that require a gradient get a place (frozen ones keep `.grad = None`);
    `params[r][i]` is trainable parameter i of replica r.

    Buckets also know when each fills: a hook on every trainable parameter of every replica marks
    its gradient ready the moment autograd has accumulated it (`mark_ready`), and when that
    completes a bucket, the ready listeners (`add_ready_listener`) hear `(replica, bucket)`, in
    the middle of backward: `GradSync` starts the bucket's allreduce there, the planner times it.

    A parameter that got no gradient anywhere in a step (a layer no replica or rank used) has its
    `.grad` hidden from the optimizer, which skips it exactly as plain PyTorch skips a parameter
    whose `.grad` is None; used somewhere, it gets the sum of the gradients like any parameter.
    In one process every replica's use is known on the host (`unused_here`). Across ranks each
    buffer ends with one *used flag* per parameter, written just before the bucket is reduced
    (`seal`), so the reduced flags say which parameters some rank used (`unused_after_reduce`).
    """

    def __init__(
        self,
        replicas_params: list[list[torch.nn.Parameter]],
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
    ):
        self.params = [[p for p in ps if p.requires_grad] for ps in replicas_params]  # [replica][parameter]
        self.layout = bucket_layout(self.params[0], bucket_bytes, first_bucket_bytes)
        self.bucket_of = {i: b for b, group in enumerate(self.layout) for i in group}
        self.num_grads = [sum(self.params[0][i].numel() for i in group) for group in self.layout]
        self.buffers: list[list[torch.Tensor]] = [[] for _ in self.params]  # [replica][bucket]
        for r, params in enumerate(self.params):
            for b, group in enumerate(self.layout):
                first = params[group[0]]
                flat = torch.zeros(self.num_grads[b] + len(group), dtype=first.dtype, device=first.device)
                offset = 0
                for i in group:
                    p = params[i]
                    # Same strides as the parameter (e.g. channels_last), as autograd's
                    # gradient layout contract asks, so accumulation stays in place.
                    p.grad = flat.as_strided(p.shape, p.stride(), offset)
                    offset += p.numel()
                self.buffers[r].append(flat)
        self.used = [[False] * len(ps) for ps in self.params]  # [replica][parameter], on the host
        self.expect_gradients()
        self._listeners: list[ReadyListener] = []
        for r, params in enumerate(self.params):
            for i, p in enumerate(params):
                p.register_post_accumulate_grad_hook(weak_hook(self._grad_ready, r, i))

    @property
    def num_buckets(self) -> int:
        return len(self.layout)

    def zero_(self) -> None:
        """Start of an optimizer step: gradients and used flags back to zero."""
        for replica in self.buffers:
            for flat in replica:
                flat.zero_()
        self.used = [[False] * len(ps) for ps in self.params]

    def expect_gradients(self) -> None:
        """Start of a backward pass: every bucket waits for all its parameters again."""
        self.pending = [[len(group) for group in self.layout] for _ in self.params]

    def add_ready_listener(self, listener: ReadyListener) -> None:
        """Call `listener(replica, bucket)` whenever a bucket of a replica gets its last gradient
        of a backward pass (listeners run in the order they were added)."""
        self._listeners.append(listener)

    def _grad_ready(self, replica: int, index: int, param: torch.nn.Parameter) -> None:
        b = self.mark_ready(replica, index)
        if b is not None:
            for listener in self._listeners:
                listener(replica, b)

    def mark_ready(self, replica: int, index: int) -> int | None:
        """Parameter `index` of `replica` has its gradient; returns its bucket if now complete."""
        self.used[replica][index] = True
        b = self.bucket_of[index]
        self.pending[replica][b] -= 1
        return b if self.pending[replica][b] == 0 else None

    def seal(self, replica: int, b: int) -> torch.Tensor:
        """Write the used flags into bucket `b`'s tail; returns the buffer, ready to be reduced."""
        flags = self.buffers[replica][b][self.num_grads[b]:]
        used = [self.used[replica][i] for i in self.layout[b]]
        if all(used):
            flags.fill_(1)  # the usual case: a fill on the device, no host-to-device copy
        else:
            flags.copy_(torch.tensor(used, dtype=flags.dtype))
        return self.buffers[replica][b]

    def unused_here(self) -> list[int]:
        """Parameters that no replica of this process produced a gradient for (host only)."""
        return [i for i in range(len(self.params[0])) if not any(used[i] for used in self.used)]

    def unused_after_reduce(self) -> list[int]:
        """After the sealed buckets were reduced across ranks: parameters no rank used.

        When this process used every parameter the answer is known on the host; only otherwise
        are the reduced flags read back (one small device-to-host copy)."""
        if not self.unused_here():
            return []
        unused = []
        for b, group in enumerate(self.layout):
            counts = self.buffers[0][b][self.num_grads[b]:].tolist()
            unused += [i for i, c in zip(group, counts) if c == 0]
        return unused

    @contextmanager
    def hidden_grads(self, indices: list[int]):
        """Set `.grad = None` on these parameters of every replica for the block (the optimizer
        step), then restore the bucket views."""
        saved = [[(params[i], params[i].grad) for i in indices] for params in self.params]
        for pairs in saved:
            for p, _ in pairs:
                p.grad = None
        try:
            yield
        finally:
            for pairs in saved:
                for p, view in pairs:
                    p.grad = view

    def allreduce(self, algorithm: str = "auto") -> None:
        """Sum every bucket across the replicas of this process."""
        for b in range(self.num_buckets):
            allreduce([replica[b] for replica in self.buffers], algorithm)
