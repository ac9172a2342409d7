"""Accelerate: the user's DataLoader (batch 16, a slow __getitem__: the steps wait on it), built at
the marked line, goes through `accelerator.prepare(...)`, which iterates a DataLoader of its own
over the same dataset with a batch sampler (its batch_size is None).

usage: accelerate_loop.py [STEPS]           (also under `python -m accelerate.commands.launch --multi_gpu
                                            --num_processes 2 ...`: 2 CPU ranks, launched by torchrun)

Prints its truth: the steps it ran and the sizes of the batches they trained on. CPU, random
weights, no downloads.
"""

import sys
import time

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, Dataset

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30
BATCH = 16


class Samples(Dataset):
    def __init__(self, n: int):
        self.x = torch.randn(n, 32)
        self.y = torch.randint(0, 4, (n,))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        time.sleep(0.0005)  # a slow read
        return self.x[i], self.y[i]


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(STEPS * BATCH), batch_size=BATCH, shuffle=True)  # built: train
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    sizes, steps = set(), 0
    for X, y in loader:
        sizes.add(len(X))
        steps += 1
        loss = nn.functional.cross_entropy(model(X), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.wait_for_everyone()  # under `accelerate launch`: no rank tears gloo down while another talks to it
    accelerator.end_training()
    print(f"accelerate_loop: steps {steps} batch {sorted(sizes)}\n", end="", flush=True)


if __name__ == "__main__":
    main()
