"""Planted: the training runs in 2 child processes (like mnist_hogwild); the parent only evaluates.

usage: trainers_in_children.py spawn|fork|forkserver
Each child runs 30 optimizer steps; the parent then runs a slow evaluation loop over a
DataLoader, which must not become the verdict.
"""

import sys
import time

import torch
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowEval(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.003)
        return torch.randn(16)


def train(model, rank):
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(30):
        X = torch.randn(64, 16)
        loss = model(X).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main():
    torch.set_num_threads(1)
    ctx = mp.get_context(sys.argv[1])
    model = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 1))
    model.share_memory()
    children = [ctx.Process(target=train, args=(model, rank)) for rank in range(2)]
    for p in children:
        p.start()
    for p in children:
        p.join()
    with torch.no_grad():
        for X in DataLoader(SlowEval(), batch_size=8):
            model(X)
    print("trainers_in_children: exit codes", [p.exitcode for p in children])


if __name__ == "__main__":
    main()
