"""Planted: a data-bound loop on a CPU whose compute already uses every core (torch's threads =
cores). DataLoader workers would take cores from the compute: the advice must not be "more workers".
"""

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Augmented(Dataset):
    def __len__(self):
        return 1024

    def __getitem__(self, i):
        x = torch.randn(784)
        for _ in range(40):  # planted: costly per-sample work
            x = torch.tanh(x * 1.01)
        return x


def main():
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 784))
    optimizer = torch.optim.Adam(model.parameters())
    for X in DataLoader(Augmented(), batch_size=64):
        loss = (model(X) - X).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("saturated_cpu: done")


if __name__ == "__main__":
    main()
