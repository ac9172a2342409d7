"""Planted: a compute-bound small CNN (batches from memory) at torch's default threads (one per
core), on cores that a busy process the test starts beside it also wants. torch's OpenMP threads
meet at the end of every op, so one of them without a core holds the others.

Its own truth, printed at the end: the median step, and the share of the time its threads had
work (ran or waited to run) that they waited for a core over the steps after warm-up, read from
/proc/self/task/*/schedstat as the kernel keeps it (no gpulab code).

    python shared_cpu.py [STEPS]
"""

import os
import statistics
import sys
import time

import torch
from torch import nn

WARMUP = 3


def thread_times() -> dict[str, tuple[int, int]]:
    """Per thread: (ns on a core, ns waiting on a run queue for one)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ran, waited, _ = f.read().split()
            out[tid] = (int(ran), int(waited))
        except OSError:
            pass
    return out


def wait_share(before: dict, after: dict) -> float:
    ran = sum(r - before.get(tid, (0, 0))[0] for tid, (r, _) in after.items())
    waited = sum(w - before.get(tid, (0, 0))[1] for tid, (_, w) in after.items())
    return waited / (ran + waited)


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 14 * 14, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    X, y = torch.randn(128, 1, 28, 28), torch.randint(0, 10, (128,))
    durations = []
    for i in range(WARMUP + steps):
        if i == WARMUP:
            before = thread_times()
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(X), y)  # planted: compute on every core, shared
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        durations.append(time.perf_counter() - t0)
    share = wait_share(before, thread_times())
    print(f"shared_cpu: {torch.get_num_threads()} threads, median step {statistics.median(durations[WARMUP:]) * 1e3:.2f} ms, "
          f"wait share {share:.3f}")


if __name__ == "__main__":
    main()
