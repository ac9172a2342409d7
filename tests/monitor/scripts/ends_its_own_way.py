"""Planted: jobs that end as their script chose, none of them a failure of the run.

usage: ends_its_own_way.py pool | child-fails | os-exit N
  pool         two forked Pool workers train 30 steps each; leaving the Pool's `with` block
               terminates them (SIGTERM), as it always does; the script exits 0
  child-fails  a forked child trains 30 steps and exits 5; the script, which only joins it, exits 0
  os-exit N    the script trains 30 steps and ends with os._exit(N): no atexit, no Python clean-up
"""

import os
import sys

import torch
import torch.multiprocessing as mp
from torch import nn


def train(seed: int) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(30):
        loss = model(torch.randn(64, 16)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def train_then_exit_5() -> None:
    train(0)
    sys.exit(5)


def main() -> None:
    how = sys.argv[1]
    ctx = mp.get_context("fork")
    if how == "pool":
        with ctx.Pool(2) as pool:
            pool.map(train, [0, 1])
    elif how == "child-fails":
        child = ctx.Process(target=train_then_exit_5)
        child.start()
        child.join()
    else:
        train(0)
        os._exit(int(sys.argv[2]))


if __name__ == "__main__":
    main()
