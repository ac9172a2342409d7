"""A healthy CPU loop: the dataset is in memory, the steps are compute-bound.

Batches are gathered with one indexing operation each (a BatchSampler hands the whole list of
indices to the dataset), not sample by sample, so loading stays tiny next to the math on any
machine. gpulab profile must not report `input_pipeline` here.
"""

import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset


def main():
    torch.manual_seed(0)
    X, y = torch.randn(2560, 512), torch.randint(0, 10, (2560,))
    data = TensorDataset(X, y)
    loader = DataLoader(data, sampler=BatchSampler(RandomSampler(data), batch_size=128, drop_last=False), batch_size=None)
    model = nn.Sequential(nn.Linear(512, 1536), nn.ReLU(), nn.Linear(1536, 1536), nn.ReLU(), nn.Linear(1536, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    running = torch.zeros(())
    for X_batch, y_batch in loader:
        loss = nn.functional.cross_entropy(model(X_batch), y_batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        running += loss.detach()  # stays a tensor: no per-step conversion to a Python float
    print(f"fast_dataset: mean loss {running.item() / len(loader):.3f}")


if __name__ == "__main__":
    main()
