"""The optimisation recipe in code: the recipe's optimizer, and its learning rate at each step."""

from __future__ import annotations

import math

import torch

from gpulab.config import Recipe


def lr_at(step: int, total_steps: int, peak: float, recipe: Recipe, warmup_steps: int = 0) -> float:
    """Learning rate for `step` (0-based): linear warm-up, then constant or cosine decay."""
    if recipe.schedule == "onecycle":
        warmup_steps = max(warmup_steps, int(recipe.warmup_frac * total_steps))
    # Never warm up for more than half the run: a 1-epoch --scale-batch run must still decay.
    warmup_steps = min(warmup_steps, total_steps // 2)
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    if recipe.schedule == "constant":
        return peak
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return peak * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(recipe: Recipe, lr: float, fused: bool = False):
    """The recipe's SGD. `fused`: torch's fused implementation, one kernel for every parameter
    (what a compiled step pairs with; the same update up to float rounding)."""

    def factory(params):
        return torch.optim.SGD(
            params, lr=lr, momentum=recipe.momentum, nesterov=recipe.nesterov, weight_decay=recipe.weight_decay,
            fused=fused or None,
        )

    return factory
