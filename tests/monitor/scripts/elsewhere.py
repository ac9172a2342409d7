"""Planted: a script that changes its working directory before and after `import torch` (as
Hydra's do), and starts a child that trains in another one. argv[1]: a folder to go to.

Trains 30 steps itself; the child, `python elsewhere.py DIR --child`, 30 more.
"""

import os
import subprocess
import sys

away = sys.argv[1]
child = "--child" in sys.argv
os.chdir(away)

import torch  # noqa: E402
from torch import nn  # noqa: E402

os.chdir(os.path.dirname(away))
model = nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
X = torch.randn(16, 8)
for _ in range(30):
    loss = model(X).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
if not child:
    subprocess.run([sys.executable, os.path.abspath(__file__), away, "--child"], cwd=away, check=True)
