"""A compiled model fed a batch whose size changes every few steps: torch.compile compiles it once
per new shape until it makes the batch dimension dynamic (a recompile, whose guard failure names
the size), and the compiles take seconds the steps do not show.

The script measures its own truth: the seconds of the steps that compiled (the first call of each
new size, by its own clock) against the median step, and how many distinct batch sizes it fed.
gpulab profile must split the compile time out of the steady steps, count the recompile with its
guard failure ("size mismatch at index 0") and the line that called the compiled model, and say
the fix (mark_dynamic / dynamic=True, or keep the size fixed).

usage: compile_recompile.py [STEPS]
"""

import statistics
import sys
import time

import torch
from torch import nn


def main(steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    compiled = torch.compile(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    sizes = [32, 48, 64]
    first_of_size, others, seen = [], [], set()
    for step in range(steps):
        n = sizes[(step // 4) % len(sizes)]  # the batch size changes every 4 steps
        X, y = torch.randn(n, 64), torch.randint(0, 10, (n,))
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(compiled(X), y)  # planted: a new input size makes it compile again
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        (first_of_size if n not in seen else others).append(time.perf_counter() - t0)
        seen.add(n)
    frames = torch._dynamo.utils.counters["frames"]["ok"]  # torch's own count of the frames it compiled
    print(f"TRUTH steps {steps} sizes {len(seen)} first_calls_s {sum(first_of_size):.2f} "
          f"median_step_ms {statistics.median(others) * 1e3:.2f} frames_compiled {frames}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 48)
