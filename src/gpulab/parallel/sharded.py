"""Sharded data parallelism (--shard fsdp): for a model that does not fit, on torch's FSDP2.

Replicated strategies keep a whole model, its gradients and its optimizer state on every rank.
Here each of the k ranks holds 1/k of each (ZeRO-3): `torch.distributed.fsdp.fully_shard` turns
each parameter into a DTensor sharded over the ranks (dim 0), and for each unit of the model
(a layer, a residual block) gathers the unit's parameters just before its forward and again for
its backward, frees them after, and reduce-scatters its gradients so that each rank keeps the
gradient of its own shard. The optimizer steps on the shards only. The price is communication:
per step about 3x the model's bytes cross the link (all-gather in forward, again in backward,
reduce-scatter), against 2x for an allreduce of the gradients.

Units (`shard_units`): LeNet's layers, ResNet-18's residual blocks, a model's top-level children
(the elements of a top-level Sequential/ModuleList of blocks), then the root, which holds what is
left. Checkpoints are sharded too (save_shards: every rank writes its own shard with
torch.distributed.checkpoint; load_shards reads them into any number of ranks). The batch rule is gpulab's (GlobalBatches: each rank its part of every global batch); FSDP
averages gradients over ranks, so each rank's loss is weighted by its part / global batch and
multiplied by k, as for DDP: the result is the gradient of the global batch's mean loss.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from gpulab.parallel.ranks import OptimizerFactory, RankStrategy
from gpulab.parallel.shard_files import read_shards
from gpulab.parallel.world import World

_CONTAINERS = (nn.Sequential, nn.ModuleList)

# torch.distributed's FSDP, DTensor and checkpoint modules are imported where they are used: they
# take ~0.5 s to import, which every `gpulab train` would pay, sharded or not.


def has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The modules wrapped one by one (each all-gathered as a whole, just before it runs): the
    top-level children that hold parameters; a top-level Sequential/ModuleList of blocks (modules
    made of layers, such as residual blocks) is split into its blocks."""
    units = []
    for child in model.children():
        if not has_parameters(child):
            continue
        blocks = [m for m in child.children() if has_parameters(m)] if isinstance(child, _CONTAINERS) else []
        if blocks and all(any(has_parameters(g) for g in b.children()) for b in blocks):
            units += blocks
        else:
            units.append(child)
    return units


def mixed_precision(dtype: torch.dtype | None):
    """FSDP's MixedPrecisionPolicy. bf16: parameters gathered and computed in bf16, gradients
    reduce-scattered in fp32, the output in fp32 (so the loss is); the shards and the optimizer
    stay fp32. None: all fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype is None:
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=torch.float32)


class Sharded(RankStrategy):
    """The training strategy of one torchrun rank with a sharded model (see the module docstring)."""

    sharded_checkpoint = True  # checkpoints through save_shards / load_shards, every rank writing

    def __init__(
        self,
        module: nn.Module,
        world: World,
        device: torch.device,
        batch_size: int,
        optimizer: OptimizerFactory = lambda p: torch.optim.SGD(p, lr=0.1),
        param_dtype: torch.dtype | None = None,
    ):
        """`batch_size`: the global batch (all ranks together) of every training step;
        `param_dtype`: bf16 as FSDP's mixed-precision policy (mixed_precision()), not torch.autocast."""
        super().__init__(module, world, device, batch_size)
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(world.group, device.type)
        policy = mixed_precision(param_dtype)
        self.units = shard_units(self.module)
        fp32 = []
        if param_dtype is not None:
            # BatchNorm in fp32: its running statistics are buffers, which the policy leaves in fp32,
            # and batch_norm refuses bf16 weights beside fp32 statistics (autocast runs it in fp32 too)
            fp32 = [m for m in self.module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
            for bn in fp32:
                fully_shard(bn, mesh=mesh, mp_policy=mixed_precision(None))
        for unit in self.units:
            if not any(unit is bn for bn in fp32):  # a BatchNorm that is a unit of its own is sharded once
                fully_shard(unit, mesh=mesh, mp_policy=policy)
        fully_shard(self.module, mesh=mesh, mp_policy=policy)
        self.param_dtype = param_dtype
        self.loss_scale = world.world_size  # FSDP averages gradients over ranks; gpulab sums them
        self.optimizers = [optimizer(self.module.parameters())]
        self.description = f"shard fsdp over {world.backend} ({len(self.units)} units + root)"
        if param_dtype is not None:
            self.description += f"; {str(param_dtype).removeprefix('torch.')} parameters gathered, fp32 gradients reduced"

    # ------------------------------------------------------------------ what the step asks

    def exchanging(self, last: bool):
        # Gradients are reduce-scattered after the last micro-batch only (no_sync's role).
        self.module.set_requires_gradient_sync(last)
        return nullcontext()

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """The whole model and optimizer state, gathered on every rank (collective); the optimizer's
        keyed by parameter name (torch.distributed.checkpoint's form), so it loads into any number
        of ranks."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                              get_optimizer_state_dict)

        self.sync_buffers()
        whole = StateDictOptions(full_state_dict=True)  # on every rank, as the replicated strategies' are
        with self.world.collectives():
            model = get_model_state_dict(self.module, options=whole)
            optimizer = get_optimizer_state_dict(self.module, self.optimizer, options=whole)
        return {"model": model, "optimizer": optimizer}

    def save_shards(self, folder: Path) -> None:
        """This rank's shard of the model and optimizer state into `folder` (collective: every
        rank writes its own file, rank 0 the metadata that ties them together)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.sync_buffers()
        model, optimizer = get_state_dict(self.module, self.optimizer)
        with self.world.collectives():
            dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=str(folder), process_group=self.world.group)

    def load_shards(self, folder: Path, trust: bool = False) -> None:
        """The state save_shards wrote, by any number of ranks: each reads the parts of the saved
        shards that make up its own (collective). `trust`: read it with torch's own reader, which
        unpickles whatever the folder holds (shard_files.py)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model, optimizer = get_state_dict(self.module, self.optimizer)
        state = {"model": model, "optimizer": optimizer}
        with self.world.collectives():
            read_shards(state, folder, trust, process_group=self.world.group)
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"])

    def full_parameters(self) -> list[torch.Tensor]:
        """Every parameter whole, in order (collective: each is all-gathered)."""
        with self.world.collectives():
            return [p.full_tensor() for p in self.module.parameters()]

    def load_state_dict(self, state: dict) -> None:
        """A whole state (as state_dict() gives it): each rank keeps its shards (collective)."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                              set_optimizer_state_dict)

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=False)
        with self.world.collectives():
            set_model_state_dict(self.module, state["model"], options=options)
            set_optimizer_state_dict(self.module, self.optimizer, state["optimizer"], options=options)

