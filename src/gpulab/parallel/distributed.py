"""One replica per torchrun rank: data parallelism across processes and machines.

Every rank holds a full model on its one device, starts from rank 0's parameters, and takes its
own part of every global batch (`gpulab.data.GlobalBatches`). After backward every rank must
hold the gradient of the whole global batch; two ways to get there:

--sync gpulab (`Distributed`, its exchange `GradSync`)
    Gradients are views into flat buckets (`Buckets`: reverse registration order, a small first
    bucket, then ~25 MiB). A hook on each parameter marks its gradient ready the moment autograd
    has accumulated it; when a bucket is complete, its `torch.distributed.all_reduce(...,
    async_op=True)` starts at once, in bucket order on every rank, while backward goes on
    computing earlier layers. The step waits for the outstanding handles only before the
    optimizer, so communication hides behind backward. Buckets whose parameters got no gradient
    this step are sent after backward, so they can neither hang nor crash the exchange.
--sync ddp (`DDPSync`)
    PyTorch's DistributedDataParallel on the same step: the reference gpulab's sync must match,
    in results (tests) and in speed (benchmarks/distributed.py).

Both sum the gradients: each rank weights its micro-batch's mean loss by micro_size / global
batch (DDP averages over ranks, so its loss is also multiplied by the world size). The sum over
ranks and micro-batches is then exactly the gradient of the global batch's mean loss, also when
the parts differ in size by one sample.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from gpulab.parallel.allreduce import BUCKET_BYTES, FIRST_BUCKET_BYTES, Buckets, weak_hook
from gpulab.parallel.ranks import OptimizerFactory, RankStrategy
from gpulab.parallel.sync_bn import convert_across_ranks
from gpulab.parallel.world import World


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


def sync_bn_group(module: nn.Module, world: World) -> None:
    """BatchNorm statistics over the whole global batch (a collective per BN layer), on a group of
    their own: BN's collectives (forward and backward) never interleave with the gradients'
    asynchronous all-reduces on the training group."""
    import torch.distributed as dist

    bn_group = dist.new_group(timeout=world.group_timeout, backend=world.backend)
    convert_across_ranks(module, bn_group)


class Distributed(RankStrategy):
    """One torchrun rank with gpulab's gradient sync (see the module docstring)."""

    def __init__(
        self,
        module: nn.Module,
        world: World,
        device: torch.device,
        batch_size: int,
        optimizer: OptimizerFactory = lambda p: torch.optim.SGD(p, lr=0.1),
        sync_bn: bool = False,
        bucket_bytes: int = BUCKET_BYTES,
        first_bucket_bytes: int = FIRST_BUCKET_BYTES,
        overlap: bool = True,
    ):
        """`batch_size`: the global batch (all ranks together) of every training step.
        `sync_bn`: BatchNorm statistics over the whole global batch."""
        super().__init__(module, world, device, batch_size)
        if sync_bn:
            sync_bn_group(self.module, world)
        self.optimizers = [optimizer(self.module.parameters())]
        self.description = f"sync gpulab over {world.backend}"
        buckets = Buckets([list(self.module.parameters())], bucket_bytes, first_bucket_bytes)
        self.grad_sync = GradSync(buckets, world.group, overlap)

    def zero_grad(self) -> None:
        self.buffers_stale = True  # a training step: evaluate / state_dict average them once again
        self.grad_sync.zero_grad()  # in place: the .grad views into the buckets stay

    def exchanging(self, last: bool):
        self.grad_sync.begin_backward(communicate=last)
        return nullcontext()

    def finish_exchange(self):
        unused = self.grad_sync.finish()
        # Parameters no rank used are skipped, as plain PyTorch skips a parameter whose .grad is None.
        return self.grad_sync.buckets.hidden_grads(unused) if unused else nullcontext()


class DDPSync(RankStrategy):
    """One torchrun rank with PyTorch's DistributedDataParallel (--sync ddp): the reference."""

    def __init__(
        self,
        module: nn.Module,
        world: World,
        device: torch.device,
        batch_size: int,
        optimizer: OptimizerFactory = lambda p: torch.optim.SGD(p, lr=0.1),
        bucket_bytes: int = BUCKET_BYTES,
    ):
        from torch.nn.parallel import DistributedDataParallel

        super().__init__(module, world, device, batch_size)
        self.loss_scale = world.world_size  # DDP averages gradients over ranks; gpulab sums them
        self.optimizers = [optimizer(self.module.parameters())]
        self.description = f"sync ddp over {world.backend}"
        self.model = DistributedDataParallel(
            self.module, device_ids=[device] if device.type == "cuda" else None, process_group=world.group,
            bucket_cap_mb=bucket_bytes / 2**20,
        )

    def exchanging(self, last: bool):
        return nullcontext() if last else self.model.no_sync()
