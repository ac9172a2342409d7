"""Pinned host memory, but `.to(device)` without `non_blocking=True`: the copy still blocks.

`pin_memory=True` only makes a copy *able* to run asynchronously; without `non_blocking=True`
the host waits for the copy engine (and so for the work queued before it) every step, exactly as
from pageable memory. The most common half-fix in the lecture notes' input pipelines. gpulab
profile must report h2d_copy at the copy line, naming non_blocking as the fix.
"""

import sys

import torch
from torch import nn


def main(steps: int = 30) -> None:
    if not torch.cuda.is_available():
        sys.exit("pinned_blocking_copy.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(4096, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    host_batches = [torch.randn(4096, 4096).pin_memory() for _ in range(2)]
    y = torch.randint(0, 10, (4096,), device=device)
    for step in range(steps):
        X = host_batches[step % 2].to(device)  # planted: pinned, but blocking (no non_blocking=True)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
