"""Planted: no training at all - a model evaluated over a DataLoader."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).eval()
    with torch.no_grad():
        for (X,) in DataLoader(TensorDataset(torch.randn(512, 16)), batch_size=32):
            model(X)
    print("inference_only: done")


if __name__ == "__main__":
    main()
