"""Planted: batches that wait in the DataLoader's iterator, out of the script's reach - worker 0
(the even batches) reads slowly, worker 1 at once, so while the loop waits for an even batch the
odd ones arrive and wait in the iterator the `for` loop holds. The dataset's and a batch's bytes
go to a JSON file, for the test to hold what the memory window says is kept against.

usage: batches_ahead.py RESULT.json
"""

import json
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

BATCH, STEPS = 64, 12


class OneSlowWorker(Dataset):
    def __init__(self):
        self.images = torch.randn(BATCH * STEPS, 3, 32, 32)
        self.labels = torch.randint(0, 10, (BATCH * STEPS,))

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        if i // BATCH % 2 == 0 and i % BATCH == 0:
            time.sleep(0.03)  # planted: worker 0's batches come late
        return self.images[i], self.labels[i]


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(16 * 32 * 32, 10))
    optimizer = torch.optim.Adam(model.parameters())
    data = OneSlowWorker()
    for X, y in DataLoader(data, batch_size=BATCH, num_workers=2):
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    with open(sys.argv[1], "w") as f:
        json.dump({"dataset": data.images.nbytes + data.labels.nbytes, "batch": X.nbytes + y.nbytes}, f)


if __name__ == "__main__":
    main()
