"""Parity: data-parallel training computes what plain PyTorch computes on one model.

The reference (`reference_training`) is plain PyTorch with nothing of gpulab in it: one model
and, for each global batch, `opt.zero_grad(); loss_fn(model(X), y).backward(); opt.step()`.
A gpulab strategy that splits the same batches over k devices or K ranks must end with the
same parameters.

In float64 the difference is rounding noise (~1e-15): it measures the algorithm. In float32 it
also measures rounding, which differs because the data-parallel run sums the gradient in a
different order; with BatchNorm, per-shard gradients partly cancel and that noise grows to ~1e-4.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch
from torch import nn


FLOAT64_TOLERANCE = 1e-9


def reference_training(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable,
    optimizer: Callable,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
) -> nn.Module:
    """A copy of `model` trained on `batches` by plain PyTorch, one optimizer step per batch."""
    model = copy.deepcopy(model).to(device=device, dtype=dtype)
    model.train()
    opt = optimizer(model.parameters())
    for X, y in batches:
        opt.zero_grad()
        loss_fn(model(X.to(device=device, dtype=dtype)), y.to(device)).backward()
        opt.step()
    return model


def reordered(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same batches with their samples in another order: the same mathematics (a mean loss,
    BatchNorm statistics and every reduction are order-free), another float summation order.
    Two plain-PyTorch runs on these measure the rounding noise of this model and these steps."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for X, y in batches:
        order = torch.randperm(len(y), generator=g)
        out.append((X[order], y[order]))
    return out


@torch.no_grad()
def max_difference(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> float:
    """The largest |difference| between corresponding tensors (e.g. two models' parameters)."""
    diffs = [(p.double().cpu() - q.double().cpu()).abs().max() for p, q in zip(a, b, strict=True)]
    return torch.stack(diffs).max().item() if diffs else 0.0
