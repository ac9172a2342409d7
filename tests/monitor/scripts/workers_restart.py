"""Planted: a DataLoader whose worker processes start again every epoch (persistent_workers off),
each taking 0.3 s to get ready (worker_init_fn: what a worker that opens files, connects or imports
does). With --persistent they start once.

gpulab profile must name the restarts with their share of the training time and the fix
persistent_workers=True, and call no epoch's first step a stall. The script prints the seconds
its passes took to start (iter() and the first batch) and its training's seconds, by its own clock.
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def get_ready(worker_id: int) -> None:
    time.sleep(0.3)  # planted: a worker's start


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(320, 32), torch.randint(0, 4, (320,)))
    loader = DataLoader(data, batch_size=16, num_workers=2, worker_init_fn=get_ready,
                        persistent_workers="--persistent" in sys.argv)
    starting_s = 0.0
    start = time.perf_counter()
    for _ in range(4):
        t0 = time.perf_counter()
        batches = iter(loader)
        X, y = next(batches)
        starting_s += time.perf_counter() - t0
        while True:
            loss = nn.functional.cross_entropy(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            try:
                X, y = next(batches)
            except StopIteration:
                break
    print(f"workers_restart: passes started in {starting_s:.2f} s of {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
