"""Planted input bottleneck: each sample takes 2 ms to "decode", the model is tiny.

gpulab profile must call this `input_pipeline`, with share >= 0.5, pointing into __getitem__.
"""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __len__(self):
        return 320

    def __getitem__(self, i):
        time.sleep(0.002)  # planted: a slow decode / disk read per sample
        return torch.randn(32), i % 4


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny ops: threads only add noise on a busy machine
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDataset(), batch_size=16, shuffle=True)
    for X, y in loader:
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print("slow_dataset: done")


if __name__ == "__main__":
    main()
