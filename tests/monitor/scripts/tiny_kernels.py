"""Launch-bound: the model loops over the samples of its batch in Python.

Every step launches thousands of kernels of a few microseconds each; the GPU spends most of the
step waiting for the CPU to issue them. gpulab profile must report launch_overhead.
"""

import sys

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
    for step in range(steps):
        loss = model(X).square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
