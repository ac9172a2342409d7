"""Planted: a per-pixel Python augmentation in __getitem__ (tens of ms per batch) behind a thin
collate_fn wrapper (a fraction of a millisecond), num_workers=0, as framework scripts have them.

The input_pipeline finding's `where` must name the augmentation line, where the data time goes,
not the wrapper, where the training thread hands the GIL over. The script measures both with its
own clock and prints them, with its whole wait for each batch (per batch, means):
"augment_behind_collate: waited W ms: augment X ms, collate Y ms".
"""

import random
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

PIXELS = 48 * 48
spent = {"augment": 0.0, "collate": 0.0, "waited": 0.0}


def augment(pixels: list[float]) -> list[float]:
    return [min(1.0, max(0.0, p * 1.1 + 0.05)) for p in pixels]  # planted: per-pixel Python augmentation


class Images(Dataset):
    def __init__(self, n: int):
        rng = random.Random(0)
        self.images = [[rng.random() for _ in range(PIXELS)] for _ in range(n)]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        t0 = time.perf_counter()
        pixels = augment(self.images[i])
        spent["augment"] += time.perf_counter() - t0
        return torch.tensor(pixels), i % 10


def collate(batch):
    """A thin wrapper around the default collate, as Lightning/HF scripts add one."""
    t0 = time.perf_counter()
    X, y = default_collate(batch)
    spent["collate"] += time.perf_counter() - t0
    return X, y


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(PIXELS, 64), nn.ReLU(), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Images(64 * 40), batch_size=64, collate_fn=collate)
    batches = iter(loader)
    while True:
        t0 = time.perf_counter()
        try:
            X, y = next(batches)
        except StopIteration:
            break
        spent["waited"] += time.perf_counter() - t0
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    ms = {k: v / len(loader) * 1e3 for k, v in spent.items()}
    print(f"augment_behind_collate: waited {ms['waited']:.2f} ms: augment {ms['augment']:.2f} ms, "
          f"collate {ms['collate']:.2f} ms")


if __name__ == "__main__":
    main()
