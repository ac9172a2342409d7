"""Layers with the numbers of torch's own and a cheaper backward.

ReLU then average pooling is two layers to autograd, and its backward three passes over the
activation, the largest tensor of a small CNN: average pooling's backward fills the input's
gradient with zeros and adds each output's share into it (a slow kernel for channels_last on the
CPU), then ReLU's backward reads that and the activation to write the gradient again. With
non-overlapping windows every input has one output, so the gradient is that output's gradient
over k*k, wherever the activation is positive: a nearest-neighbour upsampling of the smaller
gradient and one masking pass. Dividing by k*k (4) is exact in every float format, so the
gradients are bit for bit autograd's (tests/models/test_layers.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable


class ReLUAvgPool2d(nn.Module):
    """nn.ReLU() then nn.AvgPool2d(kernel_size): windows of k x k, stride k, no padding (a row or
    column left over is dropped, as AvgPool2d drops it)."""

    def __init__(self, kernel_size: int):
        super().__init__()
        self.kernel_size = kernel_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and x.requires_grad:
            return _ReLUAvgPool2d.apply(x, self.kernel_size)
        # evaluation and export see torch's two operators
        return F.avg_pool2d(F.relu(x), self.kernel_size)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}"


class _ReLUAvgPool2d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, k: int) -> torch.Tensor:
        activation = F.relu(x)
        ctx.save_for_backward(activation)
        ctx.k = k
        return F.avg_pool2d(activation, k)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        activation, = ctx.saved_tensors
        k = ctx.k
        # The gradient comes in the layout the next layer's backward gave it (flatten's: NCHW, for a
        # channels_last activation). ReLU's backward reads it beside the activation, and over two
        # layouts that pass is a strided loop, on the CPU ~10x slower than over one; the gradient
        # is k*k times smaller than the activation, so it takes the activation's layout first.
        if activation.dim() == 4 and activation.is_contiguous(memory_format=torch.channels_last):
            grad = grad.contiguous(memory_format=torch.channels_last)
        height, width = activation.shape[-2:]
        pooled_height, pooled_width = height // k * k, width // k * k
        spread = F.interpolate(grad / (k * k), size=(pooled_height, pooled_width), mode="nearest")
        if (pooled_height, pooled_width) != (height, width):  # the dropped edge gets no gradient
            spread = F.pad(spread, (0, width - pooled_width, 0, height - pooled_height))
        # ReLU's own backward: the gradient where the activation is positive, else 0
        return torch.ops.aten.threshold_backward(spread, activation, 0), None
