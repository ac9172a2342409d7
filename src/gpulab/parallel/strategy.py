"""What the training loop needs from a way of running a step: one small interface.

Three strategies implement it:

    DataParallel   one process, k devices (cpu*K, cuda:0,cuda:1, ...): replicate, split,
                   in-process allreduce, k optimizers stepping together
    Distributed    one device per torchrun rank: gpulab's bucketed gradient sync overlapped
                   with backward (--sync gpulab), or PyTorch's DDP as the reference (--sync ddp)
    Sharded        one device per torchrun rank, the model sharded over the ranks (--shard fsdp:
                   torch's FSDP2)
(the last two share their rank's state and collectives: parallel/ranks.py).

All see the same global batches (`gpulab.data.GlobalBatches`) and compute the same update as
one model stepped by plain PyTorch on those batches. Coordination between processes (who is
the main one, who prints and writes, agreeing on errors) is the `World`'s job
(`gpulab.parallel.world`), which the loop holds next to the strategy.

The few steps every strategy takes the same way are below, among them ShardStep: one shard's
forward and loss, eager or through torch.compile (`--compile`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from gpulab.parallel.meter import Meter, correct_count

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Strategy(Protocol):
    devices: list[torch.device]
    """The devices this process computes on; metrics accumulate on the first."""
    autocast: torch.dtype | None
    num_replicas: int
    """Model copies in the whole job: k devices in one process, or one per rank."""
    replicas: list[torch.nn.Module]
    """This process's copies of the model (identical after every step)."""
    description: str
    """How gradients are exchanged, for the banner ("allreduce ring", "sync gpulab over gloo")."""
    sharded_checkpoint: bool
    """False: state_dict() is whole on every process and rank 0 writes it; True (Sharded): every
    rank writes its shard (save_shards / load_shards)."""

    def set_lr(self, lr: float) -> None: ...

    def train_step(self, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, meter: Meter | None = None) -> torch.Tensor:
        """One synchronized optimizer step on this process's part of a global batch; returns
        this process's share of the batch's mean loss, on the device. Never reads the device."""
        ...

    def reduce(self, meter: Meter) -> dict[str, float]:
        """The meter's totals over every replica of the job, read on the host (collective)."""
        ...

    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn | None = None) -> dict:
        """Loss and accuracy over every sample of `batches` of every process, each counted once (collective)."""
        ...

    def state_dict(self) -> dict:
        """Model and optimizer state, identical on every process (collective: call it on all)."""
        ...

    def load_state_dict(self, state: dict) -> None: ...


def set_lr(optimizers: Iterable[torch.optim.Optimizer], lr: float) -> None:
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = lr


def forward_and_loss(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                     dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, top-1 hits) of one shard, on its device; the loss inside autocast too (it
    computes it in fp32)."""
    with autocast(X.device, dtype):
        out = model(X)
        loss = loss_fn(out, y)
    return loss, correct_count(out, y)


class ShardStep:
    """One shard's forward and loss, and its top-1 hits: the part of a training step that
    torch.compile takes over.

    `compile`: "off" runs it eagerly; "on" through torch.compile, whose AOTAutograd compiles the
    backward of what it traced too (the gradients then flow through two fused graphs, and the
    optimizer step, fused itself, follows eagerly); "graphs" as "on", replayed as CUDA graphs
    (mode="reduce-overhead": the kernel launches of a step become one replay). Shapes are static
    (every training batch has the same size: GlobalBatches drops the remainder); a shard of
    another size (an uneven split over devices) is one more compile. The loss's first call runs
    eagerly: it checks its inputs with one host read (train.build.CheckedLoss), which would
    break the graph."""

    def __init__(self, compile: str = "off"):
        self.compile = compile
        self._compiled = None
        if compile != "off":
            mode = "reduce-overhead" if compile == "graphs" else None
            self._compiled = torch.compile(forward_and_loss, mode=mode, dynamic=False)

    def __call__(self, model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                 dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self._compiled is None or not getattr(loss_fn, "checked", True):
            return forward_and_loss(model, X, y, loss_fn, dtype)
        if self.compile == "graphs":
            # a new step: the previous replay's outputs (already consumed) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return self._compiled(model, X, y, loss_fn, dtype)


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision on `device` when `dtype` is given (parameters and gradients stay fp32)."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def eval_batch(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None,
               dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, correct count) of one batch, on its device; the loss inside autocast too (it
    computes it in fp32)."""
    with autocast(X.device, dtype):
        out = model(X)
        loss_sum = loss_fn(out, y) * len(y) if loss_fn is not None else torch.zeros((), device=X.device)
    return loss_sum, correct_count(out, y)
