"""Planted Python overhead between steps: a per-element Python loop after every step.

gpulab profile must call this `low_device_utilization` and point at the loop.
"""

import torch
from torch import nn


def per_sample_bookkeeping(values: list[float]) -> float:
    total = 0.0
    for v in values:  # planted: a Python loop over 300k numbers every step
        total += v * v
    return total


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny ops: threads only add noise on a busy machine
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    values = [float(i % 7) for i in range(300_000)]
    for step in range(40):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        per_sample_bookkeeping(values)
    print("python_overhead: done")


if __name__ == "__main__":
    main()
