"""Planted: a DataLoader with a spawned worker and no `if __name__ == '__main__':` guard - the
worker imports this script, which starts another DataLoader inside it, and torch refuses; the
script's first fetch then fails with "DataLoader worker ... exited unexpectedly", before any step.

gpulab profile must lead with that failure and the guard that fixes it, not judge 0 steps' shares.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
for X, y in DataLoader(data, batch_size=8, num_workers=1, multiprocessing_context="spawn"):  # planted: no guard
    loss = nn.functional.cross_entropy(model(X), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
