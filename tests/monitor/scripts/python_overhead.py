"""Planted Python overhead between steps: a per-element Python loop after every step - and, in
two steps halfway through, a Python job between steps (a lookup table built in two halves) that
takes longer than all the steps' loops together, each half a few times a step: no outlier step
(those gpulab leaves out), a job seen in two steps only.

gpulab profile must call this `low_device_utilization` and point at the loop: a cost paid every
step is placed at a line that runs every step, never at the job that ran in two. The script
prints both times, measured by its own clock.
"""

import statistics
import time

import torch
from torch import nn

STEPS = 10
JOB_STEPS = (5, 6)
JOB_PER_STEP = 7  # times the median step so far: under the 10x that makes a step an outlier


def per_sample_bookkeeping(values: list[float]) -> float:
    total = 0.0
    for v in values:  # planted: a Python loop over 2M numbers every step
        total += v * v
    return total


def build_hash_table(seconds: float) -> int:
    acc, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for i in range(10_000):  # in two steps only: more Python than all the steps' loops together
            acc = (acc + i * 2654435761) % 1000003
    return acc


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny ops: threads only add noise on a busy machine
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    values = [float(i % 7) for i in range(2_000_000)]
    once_s = loops_s = 0.0
    steps_s = []
    for step in range(STEPS):
        began = time.perf_counter()
        if step in JOB_STEPS:
            build_hash_table(JOB_PER_STEP * statistics.median(steps_s))
            once_s += time.perf_counter() - began
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        start = time.perf_counter()
        per_sample_bookkeeping(values)
        loops_s += time.perf_counter() - start
        steps_s.append(time.perf_counter() - began)
    print(f"python_overhead: a job of {once_s:.2f} s in two steps, the loop {loops_s:.2f} s over {STEPS} steps")
    print("python_overhead: done")


if __name__ == "__main__":
    main()
