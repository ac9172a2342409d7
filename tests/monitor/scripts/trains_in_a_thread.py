"""Planted: the script trains in a thread of its own (60 optimizer steps); its main thread, which
imported torch, only starts that thread and waits for it."""

import threading

import torch
from torch import nn


def train():
    model = nn.Linear(32, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(60):
        loss = model(torch.randn(64, 32)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


trainer = threading.Thread(target=train)
trainer.start()
trainer.join()
