"""Planted run-to-run noise for `gpulab profile --try`: every step of one run sleeps the same time,
but that time changes from one run to the next (RUN_FACTORS, one factor per run, counted in the
RUN_LOG file), as when another job starts or stops between two runs. Each run appends its factor
and torch's intra-op threads (as the script set them: 2) to RUN_LOG, so a test knows the truth.
"""

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEP_S = 0.03


def this_runs_factor(log: str) -> float:
    factors = [float(f) for f in os.environ["RUN_FACTORS"].split(",")]
    runs = len(open(log).read().splitlines()) if os.path.exists(log) else 0
    return factors[runs % len(factors)]


def main():
    log = os.environ["RUN_LOG"]
    factor = this_runs_factor(log)
    torch.set_num_threads(2)
    with open(log, "a") as f:
        f.write(f"{factor} {torch.get_num_threads()}\n")
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(TensorDataset(torch.randn(400, 8), torch.randn(400, 1)), batch_size=8)
    for X, y in loader:
        time.sleep(STEP_S * factor)  # planted: this run's step time
        loss = nn.functional.mse_loss(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
