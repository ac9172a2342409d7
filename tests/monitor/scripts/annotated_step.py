"""The whole step inside `torch.profiler.record_function`, as users do to find it in a trace.

An annotation appears on the GPU track too (a `gpu_user_annotation` spanning the step's first to
last kernel); counted as a kernel it would fill every idle gap and read ~100% busy. The step
itself is item_every_step.py's: 4 ms of host work, then ~7 ms of GPU work, and a `.item()` that
makes the two take turns, so the GPU idles about a third of each step. gpulab profile must still
report host_sync at the print line and a device busy share well under 100%.
"""

import sys
import time

import torch
from torch import nn
from torch.profiler import record_function


def main(steps: int = 60) -> None:
    if not torch.cuda.is_available():
        sys.exit("annotated_step.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(2048, 4096, device=device)
    y = torch.randint(0, 10, (2048,), device=device)
    for step in range(steps):
        with record_function("train_step"):
            time.sleep(0.004)  # host-side work per step: decoding, augmentation, bookkeeping
            loss = nn.functional.cross_entropy(model(X), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            print(f"step {step}: loss {loss.item():.4f}")  # planted: a host sync every step


if __name__ == "__main__":
    main()
