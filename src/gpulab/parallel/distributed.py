"""One replica per torchrun rank: data parallelism across processes and machines.

Every rank holds a full model on its one device, starts from rank 0's parameters, and takes its
own part of every global batch (`gpulab.data.GlobalBatches`). After backward every rank must
hold the gradient of the whole global batch; two ways to get there:

--sync gpulab (`GradSync`)
    Gradients are views into flat buckets (`Buckets`: reverse registration order, a small first
    bucket, then ~25 MiB). A hook on each parameter marks its gradient ready the moment autograd
    has accumulated it; when a bucket is complete, its `torch.distributed.all_reduce(...,
    async_op=True)` starts at once, in bucket order on every rank, while backward goes on
    computing earlier layers. The step waits for the outstanding handles only before the
    optimizer, so communication hides behind backward. Buckets whose parameters got no gradient
    this step are sent after backward, so they can neither hang nor crash the exchange.
--sync ddp
    PyTorch's DistributedDataParallel on the same loop: the reference gpulab's sync must match,
    in results (tests) and in speed (benchmarks/distributed.py).

Both sum the gradients: each rank weights its micro-batch's mean loss by micro_size / global
batch (DDP averages over ranks, so its loss is also multiplied by the world size). The sum over
ranks and micro-batches is then exactly the gradient of the global batch's mean loss, also when
the parts differ in size by one sample.
"""

from __future__ import annotations

import typing
from collections.abc import Iterable
from contextlib import nullcontext

import torch
from torch import nn

from gpulab.config import Sync
from gpulab.errors import UserError
from gpulab.parallel.allreduce import BUCKET_BYTES, FIRST_BUCKET_BYTES, Buckets, weak_hook
from gpulab.parallel.data_parallel import micro_batches
from gpulab.parallel.meter import Meter
from gpulab.parallel.phases import PhaseTimer
from gpulab.parallel.ranks import OptimizerFactory, RankStrategy
from gpulab.parallel.strategy import LossFn, eval_batch
from gpulab.parallel.sync_bn import convert_across_ranks
from gpulab.parallel.world import World

SYNCS = typing.get_args(Sync)


class GradSync:
    """gpulab's gradient exchange between ranks, launched bucket by bucket during backward.

    `buckets` holds this rank's one replica; GradSync listens for its buckets filling."""

    def __init__(self, buckets: Buckets, group, overlap: bool = True):
        assert len(buckets.params) == 1, "one replica per rank"
        self.buckets = buckets
        self.group = group
        self.overlap = overlap  # False: every bucket after backward (to measure what overlap hides)
        self.communicate = True
        self.ready = [False] * self.buckets.num_buckets
        self.next_bucket = 0
        self.handles: list = []
        buckets.add_ready_listener(weak_hook(self._bucket_ready))

    def zero_grad(self) -> None:
        self.buckets.zero_()

    def begin_backward(self, communicate: bool) -> None:
        """Before each backward; `communicate=False` accumulates locally (a micro-batch that is
        not the last of its step: what DDP's no_sync does)."""
        self.buckets.expect_gradients()
        self.communicate = communicate
        self.ready = [False] * self.buckets.num_buckets
        self.next_bucket = 0

    def _bucket_ready(self, replica: int, b: int) -> None:
        if self.communicate:
            self.ready[b] = True
            if self.overlap:
                self._launch(until_ready=True)

    def _launch(self, until_ready: bool) -> None:
        """Start all-reduces in bucket order: every rank must issue the same collectives in the
        same order, whatever order its buckets happened to fill in."""
        import torch.distributed as dist

        while self.next_bucket < self.buckets.num_buckets and (self.ready[self.next_bucket] or not until_ready):
            flat = self.buckets.seal(0, self.next_bucket)
            self.handles.append(dist.all_reduce(flat, group=self.group, async_op=True))
            self.next_bucket += 1

    def finish(self) -> list[int]:
        """After the last backward of a step: send what is left, wait for every bucket.
        Returns the parameters no rank produced a gradient for."""
        self._launch(until_ready=False)
        for handle in self.handles:
            handle.wait()
        self.handles = []
        return self.buckets.unused_after_reduce()


class Distributed(RankStrategy):
    """The training strategy of one torchrun rank (see the module docstring)."""

    sharded_checkpoint = False  # its state_dict() is whole on every process; rank 0 writes it

    def __init__(
        self,
        module: nn.Module,
        world: World,
        device: torch.device,
        batch_size: int,
        optimizer: OptimizerFactory = lambda p: torch.optim.SGD(p, lr=0.1),
        sync: str = "gpulab",
        accumulate: int = 1,
        sync_bn: bool = False,
        timer: PhaseTimer | None = None,
        autocast: torch.dtype | None = None,
        compile: str = "off",
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        overlap: bool = True,
    ):
        """`batch_size`: the global batch (all ranks together) of every training step.
        `sync_bn`: BatchNorm statistics over the whole global batch (a collective per BN layer)."""
        if sync not in SYNCS:
            raise UserError(f"--sync {sync}: choose one of {', '.join(SYNCS)}")
        super().__init__(module, world, device, batch_size, accumulate, timer, autocast, compile)
        self.sync = sync
        if sync_bn:
            import torch.distributed as dist

            # Its own group: BN's collectives (forward and backward) never interleave with the
            # gradient buckets' asynchronous all-reduces on the training group.
            bn_group = dist.new_group(timeout=world.group_timeout, backend=world.backend)
            convert_across_ranks(self.module, bn_group)
        self.optimizer = optimizer(self.module.parameters())
        self.description = f"sync {sync} over {world.backend}"
        if sync == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.model = DistributedDataParallel(
                self.module, device_ids=[device] if device.type == "cuda" else None, process_group=world.group,
                bucket_cap_mb=bucket_bytes / 2**20,
            )
            self.grad_sync = None
        else:
            self.model = self.module
            buckets = Buckets([list(self.module.parameters())], bucket_bytes, first_bucket_bytes)
            self.grad_sync = GradSync(buckets, world.group, overlap)
        self.module.train(True)


    # ------------------------------------------------------------------ training

    def train_step(self, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, meter: Meter | None = None) -> torch.Tensor:
        """One synchronized step on this rank's part (X, y) of a global batch of `batch_size`."""
        self.buffers_stale = True  # evaluate / state_dict average them once again
        total = torch.zeros((), device=self.devices[0])
        parts = micro_batches(X, y, self.accumulate)
        # DDP averages gradients over ranks; gpulab sums them. Scale so both give the global mean.
        scale = self.world.world_size if self.sync == "ddp" else 1
        self._zero_grad()
        with self.world.collectives():
            for j, (X_micro, y_micro) in enumerate(parts):
                last = j == len(parts) - 1
                with self.timer.phase("forward_backward"), self._communication(last):
                    mean, correct = self.shard_step(self.model, X_micro, y_micro, loss_fn, self.autocast)
                    loss = mean * (len(y_micro) / self.batch_size)
                    (loss * scale).backward()
                total = total + loss.detach()
                if meter is not None:
                    meter.add(loss.detach() * self.batch_size, correct, len(y_micro))
            with self.timer.phase("allreduce"):  # the exchange not hidden behind backward
                unused = self.grad_sync.finish() if self.grad_sync else []
        # Parameters no rank used are skipped, as plain PyTorch skips a parameter whose .grad is None.
        hidden = self.grad_sync.buckets.hidden_grads(unused) if unused else nullcontext()
        with self.timer.phase("optimizer"), hidden:
            self.optimizer.step()
        return total

    def _zero_grad(self) -> None:
        if self.grad_sync:
            self.grad_sync.zero_grad()  # in place: the .grad views into the buckets stay
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _communication(self, last_micro_batch: bool):
        """Gradients are exchanged during the last micro-batch's backward only."""
        if self.grad_sync:
            self.grad_sync.begin_backward(communicate=last_micro_batch)
            return nullcontext()
        return nullcontext() if last_micro_batch else self.model.no_sync()

    # ------------------------------------------------------------------ metrics, evaluation, state

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn | None = None) -> dict:
        """This rank's part of the test set, then every rank's sums combined: each sample once."""
        self.sync_buffers()
        self.module.train(False)
        meter = Meter(self.devices[0])
        for X, y in batches:
            meter.add(*eval_batch(self.module, X, y, loss_fn, self.autocast), len(y))
        self.module.train(True)
        return self.reduce(meter)

    def state_dict(self) -> dict:
        self.sync_buffers()
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
