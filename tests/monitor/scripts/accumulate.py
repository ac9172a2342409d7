"""Planted: gradient accumulation - 4 backward() per optimizer.step(), 8 optimizer steps.

The optimizer rule must win: 8 steps, the first one holding its 4 micro-batches."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
    model = nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (X, y) in enumerate(DataLoader(data, batch_size=8)):
        (((model(X) - y) ** 2).mean() / 4).backward()
        if (i + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
    print("accumulate: done")


if __name__ == "__main__":
    main()
