"""Data parallelism in one process, from scratch, as the textbook's multi-GPU chapter builds it.

Each of k devices keeps a full copy of the model. A minibatch is split into k shards; each
device computes the loss and gradients of its shard; the gradients are summed across devices
(allreduce) so every replica holds the gradient of the whole minibatch; every replica applies
the same update. The replicas therefore stay identical, and k-device training computes the
same model as 1-device training on the same batches (tests/parallel prove it on `cpu*k`).

Two details make that equality exact rather than approximate:
- each shard's mean loss is weighted by shard_size / batch_size before backward, so the summed
  gradient is the gradient of the full-batch mean even when shards differ in size;
- with `sync_bn=True` BatchNorm uses whole-minibatch statistics (see `sync_bn.py`).

Nothing in `train_step` reads a value back to the host: on GPUs the k forward/backward passes
are launched back to back and run concurrently, and the running loss/accuracy stay on device 0.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from functools import partial

import torch
from torch import nn

from gpulab.devices import device_of, place
from gpulab.errors import UserError
from gpulab.parallel.allreduce import BUCKET_BYTES, Buckets, choose
from gpulab.parallel.graphed import StepGraph
from gpulab.parallel.meter import Meter
from gpulab.parallel.phases import PhaseTimer
from gpulab.parallel.strategy import LossFn, ShardStep, eval_batch, set_lr
from gpulab.parallel.sync_bn import convert_to_sync, exchanges


def replicate(module_or_params, devices: list[torch.device]):
    """One independent copy per device, with gradients enabled.

    Accepts an `nn.Module` (returns a list of modules) or a list of tensors (returns a list of
    lists of leaf tensors, like the chapter's `get_params`). Copies are independent even when
    two devices are the same (`cpu*2`).
    """
    if isinstance(module_or_params, nn.Module):
        device_of(module_or_params)  # one clear error if the module spans devices
        return [copy.deepcopy(module_or_params).to(d) for d in devices]
    params = list(module_or_params)
    return [[p.detach().to(d, copy=True).requires_grad_() for p in params] for d in devices]


def split_batch(X: torch.Tensor, y: torch.Tensor, devices: list[torch.device]):
    """Split a minibatch into len(devices) shards, shard i on device i; sizes differ by <= 1."""
    if len(X) != len(y):
        raise UserError(f"split_batch: X has {len(X)} samples but y has {len(y)}; they must match")
    k = len(devices)
    if len(X) < k:
        raise UserError(
            f"split_batch: a batch of {len(X)} cannot be split over {k} devices; use a batch size >= {k}"
        )
    if k == 1:
        return [place(X, devices[0])], [place(y, devices[0])]
    X_shards = [place(s, d) for s, d in zip(torch.tensor_split(X, k), devices)]
    y_shards = [place(s, d) for s, d in zip(torch.tensor_split(y, k), devices)]
    return X_shards, y_shards


def micro_batches(X: torch.Tensor, y: torch.Tensor, accumulate: int):
    """`accumulate` micro-batches of (X, y), computed one after another to save memory."""
    parts = min(accumulate, len(y))
    return list(zip(torch.tensor_split(X, parts), torch.tensor_split(y, parts)))


class DataParallel:
    """One process, k devices: the textbook's data parallelism (see the module docstring)."""

    sharded_checkpoint = False  # its state_dict() is whole on every process; rank 0 writes it

    def __init__(
        self,
        module: nn.Module,
        devices: list[torch.device],
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.1),
        allreduce: str = "auto",
        sync_bn: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        timer: PhaseTimer | None = None,
        autocast: torch.dtype | None = None,
        accumulate: int = 1,
        compile: str = "off",
    ):
        """`autocast`: run forward passes under torch.autocast with this dtype (e.g. bfloat16);
        parameters, gradients and the optimizer stay float32 (mixed precision).
        `timer`: a PhaseTimer to time the step's phases (default: one that times nothing).
        `accumulate`: compute each batch as this many micro-batches, one after another.
        `compile`: how each replica's forward and loss run (ShardStep: off, on, graphs); "graphs"
        on one GPU records the whole step, optimizer included, as one CUDA graph (StepGraph)."""
        if not devices:
            raise UserError("DataParallel needs at least one device")
        self.devices = list(devices)
        self.num_replicas = len(self.devices)
        self.autocast = autocast
        self.buffers_stale = True
        self.accumulate = accumulate
        self.replicas = replicate(module, self.devices)
        self.sync_bn = sync_bn and len(self.devices) > 1
        if self.sync_bn:
            convert_to_sync(self.replicas)
        self.optimizers = [optimizer(r.parameters()) for r in self.replicas]
        self.train(True)  # set once here (evaluate restores it), not walked every step
        # Its hooks track which parameters got a gradient (the optimizer skips the others).
        self.buckets = Buckets([list(r.parameters()) for r in self.replicas], bucket_bytes)
        probes = [torch.empty(0, device=d) for d in self.devices]
        self.allreduce_algorithm = choose(probes, allreduce) if len(self.devices) > 1 else "none"
        self.description = f"allreduce {self.allreduce_algorithm}"
        self.timer = timer or PhaseTimer(self.devices, enabled=False)
        # One GPU, one micro-batch: the step is the device's whole work, so it is recorded whole
        # (its forward compiled; the graph is gpulab's). Several devices exchange gradients in
        # between: torch.compile's CUDA graphs around each forward and backward.
        whole = compile == "graphs" and len(self.devices) == 1 and accumulate == 1
        self.shard_step = ShardStep("on" if whole else compile)
        # recorded by the first training step; untimed: a replay is one piece of work
        untimed = partial(self._step, timer=PhaseTimer([], enabled=False))
        self.graph = StepGraph(untimed, self.replicas, self.optimizers, self.devices[0]) if whole else None

    @property
    def module(self) -> nn.Module:
        """The replica on the first device (all replicas hold the same parameters)."""
        return self.replicas[0]

    def set_lr(self, lr: float) -> None:
        set_lr(self.optimizers, lr)
        if self.graph is not None:
            self.graph.set_lr(lr)

    def train(self, mode: bool = True) -> None:
        for r in self.replicas:
            r.train(mode)

    # ------------------------------------------------------------------ training

    def train_step(self, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, meter: Meter | None = None) -> torch.Tensor:
        """One synchronized step on the whole minibatch; returns its mean loss (on device 0).

        `loss_fn` must return the *mean* loss over its inputs (PyTorch's default reduction).
        """
        self.buffers_stale = True  # evaluate / state_dict average them once again
        if self.graph is not None:
            loss, correct = self.graph(X, y, loss_fn)  # the graph's outputs: rewritten by the next replay
        else:
            loss, correct = self._step(X, y, loss_fn, self.timer)
        if meter is not None:
            meter.add(loss * len(y), correct, len(y))
        return loss

    def _step(self, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, timer: PhaseTimer):
        """(the batch's mean loss, its top-1 hits), on device 0, after the optimizers' step."""
        n = len(y)
        first = self.devices[0]
        self.buckets.zero_()
        total, correct = torch.zeros((), device=first), torch.zeros((), dtype=torch.long, device=first)
        for X_micro, y_micro in micro_batches(X, y, self.accumulate):
            with timer.phase("scatter"):
                X_shards, y_shards = split_batch(X_micro, y_micro, self.devices)
            with timer.phase("forward_backward"):
                self.buckets.expect_gradients()
                losses, corrects = self._forward(X_shards, y_shards, loss_fn, n)
                torch.autograd.backward(losses)
            total = total + sum(place(l.detach(), first) for l in losses)
            correct = correct + sum(place(c, first) for c in corrects)
        with timer.phase("allreduce"):
            if len(self.devices) > 1:
                self.buckets.allreduce(self.allreduce_algorithm)
        with timer.phase("optimizer"):
            # A parameter no replica used gets no update, as plain PyTorch skips a None .grad.
            with self.buckets.hidden_grads(self.buckets.unused_here()):
                for opt in self.optimizers:
                    opt.step()
        return total, correct

    def _forward(self, X_shards, y_shards, loss_fn: LossFn, n: int):
        def run(i: int):
            mean, correct = self.shard_step(self.replicas[i], X_shards[i], y_shards[i], loss_fn, self.autocast)
            weight = len(y_shards[i]) / n  # shard mean -> its share of the batch mean
            return mean * weight, correct

        if not self.sync_bn:
            results = [run(i) for i in range(len(self.devices))]
        else:
            results = self._run_in_threads(run)
        return [r[0] for r in results], [r[1] for r in results]

    def _run_in_threads(self, fn):
        """Run fn(i) for every replica concurrently; sync BN layers rendezvous inside."""
        results, errors = [None] * len(self.devices), []

        def worker(i):
            try:
                if self.devices[i].type == "cuda":
                    torch.cuda.set_device(self.devices[i])
                results[i] = fn(i)
            except BaseException as e:  # release the others from their barriers, re-raise below
                errors.append(e)
                for ex in exchanges(self.replicas):
                    ex.abort()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(self.devices))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
            raise (real or errors)[0]
        return results

    def reduce(self, meter: Meter) -> dict[str, float]:
        return meter.read()  # every replica's totals are already on device 0

    # ------------------------------------------------------------------ evaluation and state

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Average BatchNorm running statistics across replicas (they drift apart with per-device BN)."""
        if len(self.devices) == 1 or not self.buffers_stale:
            return
        self.buffers_stale = False
        per_replica = [[b for b in r.buffers() if b.is_floating_point()] for r in self.replicas]
        for bufs in zip(*per_replica):
            mean = sum(place(b, self.devices[0]) for b in bufs) / len(bufs)
            for b in bufs:
                b.copy_(mean)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn | None = None) -> dict:
        """Accuracy (and mean loss) over `batches`, each batch spread over every device."""
        self.sync_buffers()
        self.train(False)
        meter = Meter(self.devices[0])
        for X, y in batches:
            if len(y) < len(self.devices):  # a last batch smaller than k: give it to device 0
                X_shards, y_shards = [place(X, self.devices[0])], [place(y, self.devices[0])]
            else:
                X_shards, y_shards = split_batch(X, y, self.devices)
            first = self.devices[0]
            sums = [eval_batch(r, x, t, loss_fn, self.autocast) for r, x, t in zip(self.replicas, X_shards, y_shards)]
            meter.add(sum(place(l, first) for l, _ in sums), sum(place(c, first) for _, c in sums), len(y))
        self.train(True)
        return meter.read()

    def state_dict(self) -> dict:
        self.sync_buffers()
        return {"model": self.module.state_dict(), "optimizer": self.optimizers[0].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for replica, opt in zip(self.replicas, self.optimizers):
            replica.load_state_dict(state["model"])
            # A copy per replica: on the same device Optimizer.load_state_dict does not copy, and
            # virtual replicas (cpu*K) would otherwise share, and K-fold update, one momentum buffer.
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))
