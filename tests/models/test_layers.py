"""ReLUAvgPool2d computes what nn.ReLU then nn.AvgPool2d compute, gradients bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from gpulab.models.layers import ReLUAvgPool2d

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def torchs(x: torch.Tensor, k: int) -> torch.Tensor:
    return F.avg_pool2d(F.relu(x), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last])
@pytest.mark.parametrize("size", [8, 9])  # 9: the last row and column are dropped, as LeNet's 9x9 -> 4x4
def test_values_and_gradients_are_torchs_bit_for_bit(dtype, layout, size):
    torch.manual_seed(0)
    base = torch.randn(3, 5, size, size, dtype=dtype).to(memory_format=layout)
    base[0, 0, 0, 0] = 0.0  # ReLU's kink: its gradient there is 0
    grad = torch.randn(3, 5, size // 2, size // 2, dtype=dtype)
    outs, grads = [], []
    for layer in (lambda x: torchs(x, 2), ReLUAvgPool2d(2)):
        x = base.clone().requires_grad_()
        out = layer(x)
        out.backward(grad)
        outs.append(out)
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(grads[0], grads[1])
    assert grads[1].dtype == dtype
    assert grads[1][:, :, size // 2 * 2:].count_nonzero() == 0


def test_its_gradient_flows_into_the_layer_before():
    """Through a convolution, under bf16 autocast, as LeNet uses it: the weight's gradient is the
    one autograd computes through torch's two layers."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 4, 3)
    x = torch.randn(2, 1, 11, 11)
    grads = []
    for layer in (lambda h: torchs(h, 2), ReLUAvgPool2d(2)):
        conv.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(conv(x)).float().square().sum().backward()
        grads.append(conv.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])



class StridesOf(TorchDispatchMode):
    """The strides of the tensors each call of `op` was given."""

    def __init__(self, op):
        super().__init__()
        self.op, self.calls = op, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is self.op:
            self.calls.append([a.stride() for a in args if isinstance(a, torch.Tensor)])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("size", [8, 9])
def test_relus_backward_reads_the_gradient_in_the_activations_layout(size):
    """Under channels_last the gradient arrives NCHW (flatten's backward gives it so, as in LeNet);
    ReLU's backward over two layouts is a strided pass, ~10x slower on the CPU than over one."""
    x = torch.randn(4, 6, size, size).to(memory_format=torch.channels_last).requires_grad_()
    out = ReLUAvgPool2d(2)(x)
    with StridesOf(torch.ops.aten.threshold_backward.default) as relu_backward:
        out.backward(torch.randn(out.shape))
    [(gradient, activation)] = relu_backward.calls
    assert gradient == activation == x.stride()
