"""Planted: a script that lets go of tensors - the raw data once its dataset is made, each batch
once the next replaces it - and checks through weak references that each is freed, writing what
it found to a JSON file. Profiling must not keep any of them alive.

usage: lets_go.py RESULT.json
"""

import json
import sys
import weakref

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def train(steps: int, out: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters())
    raw = torch.randn(32 * steps, 64)
    loader = DataLoader(TensorDataset(raw * 2, torch.randint(0, 10, (32 * steps,))), batch_size=32)
    raw_data = weakref.ref(raw)
    del raw
    raw_data_freed = raw_data() is None
    kept, previous = [], None
    for step, (X, y) in enumerate(loader):
        if previous is not None and previous() is not None:
            kept.append(step)
        previous = weakref.ref(X)
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(X), y).backward()
        optimizer.step()
    with open(out, "w") as f:
        json.dump({"raw_data_freed": raw_data_freed, "steps_whose_previous_batch_lived_on": kept}, f)


if __name__ == "__main__":
    train(8, sys.argv[1])
