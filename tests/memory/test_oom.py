"""An out-of-memory error read where it happened (memory/oom.py), held against the bytes the test
itself put there."""

import sys

import torch
from torch import nn

from gpulab.memory.oom import read_out_of_memory

MIB = 2**20


def test_a_gradient_flowing_through_backward_is_no_input():
    """Out of memory in a tensor hook during backward: the hook's argument is the gradient flowing
    through backward - counted as the batch, it inflated the inputs (a helper's finding)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x, y = torch.randn(512, 256), torch.randn(512, 256)  # 0.5 MiB each: the batch

    def ask_too_much(grad):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 40000000000000 bytes.")

    h = model[1](model[0](x))
    h.register_hook(ask_too_much)
    loss = nn.functional.mse_loss(model[2](h), y)
    try:
        loss.backward()
    except RuntimeError as e:
        oom = read_out_of_memory(e, sys.exc_info()[2], [model], [], lambda frame: None)
    assert oom["phase"] == "backward" and oom["requested"] == 40_000_000_000_000
    assert oom["in_use"]["inputs"] == 1 * MIB  # x and y, not the 0.5 MiB gradient in the hook
