"""Planted: a data wait that is a sleep (a slow read per sample) with torch at its default threads
(one per core), as an HF Trainer script runs: the training's threads take every core by count, yet
the cores sit idle while the main thread sleeps in __getitem__. DataLoader workers pay here.

usage: sleepy_dataset.py [WORKERS]   (default 0: the main thread reads)
"""

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowReads(Dataset):
    def __len__(self):
        return 640  # 40 steps: the samples inside the steady steps span over a second

    def __getitem__(self, i):
        time.sleep(0.002)  # planted: a slow read per sample, no CPU used
        return torch.randn(64), i % 4


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    workers = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    for X, y in DataLoader(SlowReads(), batch_size=16, shuffle=True, num_workers=workers):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"sleepy_dataset: done ({torch.get_num_threads()} torch threads)")


if __name__ == "__main__":
    main()
