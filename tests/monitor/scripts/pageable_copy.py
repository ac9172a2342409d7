"""Every step copies a 64 MB batch to the GPU from pageable (not pinned) memory, blocking.

The model is tiny, so the copy is most of the step. gpulab profile must report h2d_copy at the
copy line.
"""

import sys

import torch
from torch import nn


def main(steps: int = 30) -> None:
    if not torch.cuda.is_available():
        sys.exit("pageable_copy.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(4096, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    host_batches = [torch.randn(4096, 4096) for _ in range(2)]  # pageable: never pinned
    y = torch.randint(0, 10, (4096,), device=device)
    for step in range(steps):
        X = host_batches[step % 2].to(device)  # planted: a blocking copy from pageable memory
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
