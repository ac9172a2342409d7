"""Planted: a script that profiles itself with gpulab's Python API and marks its steps with
p.step() - 10 of them, among 30 optimizer steps. argv[1]: the API's out folder."""

import sys

import torch
from torch import nn

import gpulab.monitor

model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with gpulab.monitor.profile(out=sys.argv[1], quiet=True) as p:
    for i in range(30):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % 3 == 2:
            p.step()
print("uses_the_api: done")
