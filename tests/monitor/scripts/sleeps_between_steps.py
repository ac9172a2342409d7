"""A planted wait between steps: the loop sleeps after every step (as a script that polls a file,
throttles itself or waits on a request would), where the thread runs no Python at all.

gpulab profile must place it at the sleep's line and call it a wait - with the fix that takes the
wait out of the loop, not one that speeds Python up. The script prints the seconds it slept and
the seconds its steps took, by its own clock.
"""

import time

import torch
from torch import nn


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(64, 64), torch.randint(0, 4, (64,))
    slept_s = 0.0
    start = time.perf_counter()
    for _ in range(40):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t0 = time.perf_counter()
        time.sleep(0.02)  # planted: a wait every step
        slept_s += time.perf_counter() - t0
    print(f"sleeps_between_steps: slept {slept_s:.2f} s of {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
