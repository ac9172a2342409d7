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

The step itself is gpulab.train.step's (Trainer.train_step), the same for every strategy;
DataParallel holds the replicas and their optimizers and exchanges their gradients. Nothing in
it reads a value back to the host: on GPUs the k forward/backward passes are launched back to
back and run concurrently, and the running loss/accuracy stay on device 0.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
from torch import nn

from gpulab.devices import device_of
from gpulab.errors import UserError
from gpulab.parallel.allreduce import BUCKET_BYTES, Buckets, choose
from gpulab.parallel.strategy import Shard
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
        return [X.to(devices[0])], [y.to(devices[0])]  # .to: the tensor itself when it is there already
    X_shards = [s.to(d) for s, d in zip(torch.tensor_split(X, k), devices)]
    y_shards = [s.to(d) for s, d in zip(torch.tensor_split(y, k), devices)]
    return X_shards, y_shards


class DataParallel:
    """One process, k devices: the textbook's data parallelism (see the module docstring)."""

    sharded_checkpoint = False  # its state_dict() is whole on every process; rank 0 writes it
    loss_scale = 1  # the buckets sum the replicas' gradients

    def __init__(
        self,
        module: nn.Module,
        devices: list[torch.device],
        optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = lambda p: torch.optim.SGD(p, lr=0.1),
        allreduce: str = "auto",
        sync_bn: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
    ):
        """`sync_bn`: BatchNorm over the whole batch (the replicas' forwards then run in threads
        that meet inside it)."""
        if not devices:
            raise UserError("DataParallel needs at least one device")
        self.devices = list(devices)
        self.num_replicas = len(self.devices)
        self.buffers_stale = True
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

    @property
    def module(self) -> nn.Module:
        """The replica on the first device (all replicas hold the same parameters)."""
        return self.replicas[0]

    def train(self, mode: bool = True) -> None:
        for r in self.replicas:
            r.train(mode)

    # ------------------------------------------------------------------ what the step asks

    def global_batch(self, local: int) -> int:
        return local  # the whole batch is this process's

    def split(self, X: torch.Tensor, y: torch.Tensor) -> list[Shard]:
        return list(zip(*split_batch(X, y, self.devices)))

    def each(self, fn, shards: list[Shard]) -> list[tuple]:
        if not self.sync_bn:
            return [fn(r, X, y) for r, (X, y) in zip(self.replicas, shards)]
        return self._run_in_threads(lambda i: fn(self.replicas[i], *shards[i]))

    def zero_grad(self) -> None:
        self.buffers_stale = True  # a training step: evaluate / state_dict average them once again
        self.buckets.zero_()  # in place: the .grad views into the buckets stay

    def exchanging(self, last: bool):
        self.buckets.expect_gradients()
        return nullcontext()  # the replicas' gradients are summed after the last backward

    def finish_exchange(self):
        if len(self.devices) > 1:
            self.buckets.allreduce(self.allreduce_algorithm)
        return self.buckets.hidden_grads(self.buckets.unused_here())

    def collectives(self):
        return nullcontext()  # no other process

    def sum_over_processes(self, t: torch.Tensor) -> None:
        pass  # every replica's totals are already on device 0

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

    # ------------------------------------------------------------------ buffers and state

    @torch.no_grad()
    def sync_buffers(self) -> None:
        """Average BatchNorm running statistics across replicas (they drift apart with per-device BN)."""
        if len(self.devices) == 1 or not self.buffers_stale:
            return
        self.buffers_stale = False
        per_replica = [[b for b in r.buffers() if b.is_floating_point()] for r in self.replicas]
        for bufs in zip(*per_replica):
            mean = sum(b.to(self.devices[0]) for b in bufs) / len(bufs)
            for b in bufs:
                b.copy_(mean)

    def state_dict(self) -> dict:
        self.sync_buffers()
        return {"model": self.module.state_dict(), "optimizer": self.optimizers[0].state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for replica, opt in zip(self.replicas, self.optimizers):
            replica.load_state_dict(state["model"])
            # A copy per replica: on the same device Optimizer.load_state_dict does not copy, and
            # virtual replicas (cpu*K) would otherwise share, and K-fold update, one momentum buffer.
            opt.load_state_dict(copy.deepcopy(state["optimizer"]))
