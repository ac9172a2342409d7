"""Planted Python overhead between steps: a per-element Python loop after every step - and,
once halfway through, a Python job between two steps (a lookup table built on first need) that
takes longer than all the steps' loops together.

gpulab profile must call this `low_device_utilization` and point at the loop: a cost paid every
step is placed at a line that runs every step, never at the job that ran once. The script
prints both times, measured by its own clock.
"""

import time

import torch
from torch import nn


def per_sample_bookkeeping(values: list[float]) -> float:
    total = 0.0
    for v in values:  # planted: a Python loop over 300k numbers every step
        total += v * v
    return total


def build_hash_table(n: int) -> int:
    acc = 0
    for i in range(n):  # once, halfway: more Python than all the steps' loops together
        acc = (acc + i * 2654435761) % 1000003
    return acc


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny ops: threads only add noise on a busy machine
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    values = [float(i % 7) for i in range(300_000)]
    once_s = loops_s = 0.0
    for step in range(40):
        if step == 20:
            start = time.perf_counter()
            build_hash_table(10_000_000)
            once_s = time.perf_counter() - start
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        start = time.perf_counter()
        per_sample_bookkeeping(values)
        loops_s += time.perf_counter() - start
    print(f"python_overhead: a job of {once_s:.2f} s once, the loop {loops_s:.2f} s over 40 steps")
    print("python_overhead: done")


if __name__ == "__main__":
    main()
