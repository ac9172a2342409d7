"""Parity: k-device data-parallel training computes the same model as 1-device training.

`max_parameter_difference` trains two copies of one model on the same batches, one on a single
device and one data-parallel over `devices`, and returns the largest absolute difference
between any parameter of any replica and the single-device model.

In float64 the difference is rounding noise (~1e-15): it measures the algorithm. In float32 it
also measures rounding, which differs because the k-device run sums the gradient in a different
order; with BatchNorm, per-shard gradients partly cancel and that noise grows to ~1e-4.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn

from gpulab.parallel.data_parallel import DataParallel

FLOAT64_TOLERANCE = 1e-9


def max_parameter_difference(
    model: nn.Module,
    devices: list[torch.device],
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    optimizer: Callable,
    dtype: torch.dtype = torch.float64,
    allreduce: str = "auto",
) -> float:
    model = copy.deepcopy(model).to(dtype)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    single = DataParallel(model, devices[:1], optimizer=optimizer)
    # Per-device BatchNorm is a different computation by design; parity holds with sync BN.
    multi = DataParallel(model, devices, optimizer=optimizer, allreduce=allreduce, sync_bn=has_bn)
    for X, y in batches:
        X = X.to(dtype)
        single.train_step(X, y, loss_fn)
        multi.train_step(X, y, loss_fn)
    reference = [p.detach().to(devices[0]) for p in single.module.parameters()]
    diff = torch.zeros((), dtype=torch.float64)
    for replica in multi.replicas:
        for p, ref in zip(replica.parameters(), reference):
            diff = torch.maximum(diff, (p.detach().to(devices[0]) - ref).abs().max().double().cpu())
    return diff.item()


def check_parity_cli(cfg, num_steps: int = 5) -> int:
    """`gpulab train --check-parity`: a few steps both ways on the chosen devices, reported."""
    from rich.console import Console
    from rich.markup import escape

    from gpulab.devices import format_devices
    from gpulab.train.loop import build, make_optimizer

    console = Console(highlight=False, soft_wrap=True)
    run = build(cfg)  # the run's own data, batches, initial model and loss: nothing rebuilt here
    batches = [b for _, b in zip(range(num_steps), run.train_loader)]
    optimizer = make_optimizer(cfg.recipe_spec, run.peak_lr)

    console.print(escape(
        f"parity: {cfg.model}, {num_steps} steps of batch {run.batch_size}, 1 device vs {format_devices(run.devices)}"
    ))
    results = {}
    for dtype in (torch.float32, torch.float64):
        results[dtype] = max_parameter_difference(
            run.strategy.module, run.devices, batches, run.loss_fn, optimizer, dtype, cfg.allreduce
        )
        console.print(f"  {str(dtype).removeprefix('torch.'):8} max |param difference| = {results[dtype]:.3e}")
    ok = results[torch.float64] <= FLOAT64_TOLERANCE
    console.print(
        f"parity {'PASS' if ok else 'FAIL'}: float64 difference {'<=' if ok else '>'} {FLOAT64_TOLERANCE:g} "
        "(float32 differences are summation-order rounding)"
    )
    return 0 if ok else 1
