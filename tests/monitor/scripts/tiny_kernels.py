"""Launch-bound: the model loops over the samples of its batch in Python.

Every step launches ~900 kernels of a few microseconds each (per sample: the 32x32 layer and
tanh forward, their gradients backward); the GPU spends most of the step waiting for the CPU to
issue them. gpulab profile must report launch_overhead.

Not sized from the device: the cause dominates on any card. A kernel of one 32-float row does
almost nothing, so its GPU time is the card's fixed cost per kernel, ~1-2 us on an H100/H200
(measured on the H200: median 1.1 us) and at most ~5 us on a T4; while issuing one op from
Python through PyTorch's dispatcher to a launch costs the host 10-25 us on any CPU these cards
sit in (measured on the H200's host: ~22 ms per step of ~900 kernels). So the GPU works
~1-5 ms of each ~15-25 ms step: at most a third even on a T4, ~6% on an H100, and less on a
B200, whose kernels are no slower. The kernel count does not depend on the card either (>= 500
per step, each well under 20 us, is what tests/monitor/test_gpu.py checks).

At the end, once, what it measured itself (perf_counter, medians over the steps; the forward is
where the Python loop over samples runs):
  TRUTH script tiny_kernels.py step_ms 22.4 forward_ms 9.1 samples_per_step 128 steps 30
"""

import statistics
import sys
import time

import torch
from torch import nn


class PerSampleMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = [torch.tanh(self.layer(x[i])) for i in range(x.shape[0])]  # planted: a Python loop over samples
        return torch.stack(rows)


def main(steps: int = 30) -> None:
    if not torch.cuda.is_available():
        sys.exit("tiny_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = PerSampleMLP().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(128, 32, device=device)
    step_s, forward_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        out = model(X)
        forward_s.append(time.perf_counter() - t0)
        loss = out.square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"TRUTH script tiny_kernels.py step_ms {statistics.median(step_s) * 1e3:.1f} "
          f"forward_ms {statistics.median(forward_s) * 1e3:.1f} samples_per_step {X.shape[0]} steps {steps}", flush=True)


if __name__ == "__main__":
    main()
