"""Planted: per-sample transforms that are nn.Modules (like torchvision's Normalize), run inside
__getitem__ with num_workers=0, plus a plain-callable one. The script measures its own data wait
(time blocked in next() of the training loop) and prints its share of a step's time, the median
over its steps: the steady state, as gpulab's shares are (a profiler's measurement windows make a
step or two slower than the rest; a median over the steps is not moved by them).
"""

import statistics
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Normalize(nn.Module):
    """Per-sample normalization, deliberately costly, as an nn.Module."""

    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x):
        for _ in range(20):
            x = (x - self.mean) / self.std * self.std + self.mean
        return (x - self.mean) / self.std


class AddNoise:
    """A plain-callable transform (not an nn.Module)."""

    def __call__(self, x):
        time.sleep(0.0005)
        return x + 0.01 * torch.randn_like(x)


class Images(Dataset):
    def __init__(self):
        self.images = torch.randn(512, 3, 32, 32)
        self.normalize = Normalize(0.5, 0.25)
        self.noise = AddNoise()

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.noise(self.normalize(self.images[i])), i % 10  # planted: per-sample transforms


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, 16, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 30 * 30, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Images(), batch_size=32)
    shares = []
    it = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            X, y = next(it)
        except StopIteration:
            break
        waited = time.perf_counter() - t0
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        shares.append(waited / (time.perf_counter() - t0))
    print(f"transforms_in_getitem: data share {statistics.median(shares):.3f}")


if __name__ == "__main__":
    main()
