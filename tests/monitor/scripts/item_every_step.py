"""A per-step `.item()` on CUDA (the textbook's warning): the host waits for the GPU every step.

Each step first does 4 ms of host-side work (standing in for reading and augmenting a batch),
then ~7 ms of GPU work (a 3-layer MLP, fp32, on an H100). Without a sync, the host prepares step
k+1 while the GPU runs step k, and a step takes ~7 ms; the `.item()` in the print makes them take
turns instead (~11 ms), so the GPU idles a third of each step. gpulab profile must report
host_sync at the print line.
"""

import sys
import time

import torch
from torch import nn


def prepare_batch_on_host(X: torch.Tensor) -> torch.Tensor:
    time.sleep(0.004)  # host-side work per step: decoding, augmentation, bookkeeping
    return X


def main(steps: int = 60) -> None:
    if not torch.cuda.is_available():
        sys.exit("item_every_step.py needs a CUDA GPU")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # the default, stated: the GPU time above assumes fp32
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(2048, 4096, device=device)
    y = torch.randint(0, 10, (2048,), device=device)
    for step in range(steps):
        batch = prepare_batch_on_host(X)
        loss = nn.functional.cross_entropy(model(batch), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")  # planted: a host sync every step


if __name__ == "__main__":
    main()
