"""Boolean-mask indexing on CUDA: the result's size depends on the data, so the host must wait.

torch reports this sync (sync debug mode) inside a call gpulab does not wrap; gpulab profile
must still list it at the indexing line.
"""

import sys

import torch
from torch import nn


def main(steps: int = 20) -> None:
    if not torch.cuda.is_available():
        sys.exit("masked_index.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(256, 256).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(512, 256, device=device)
    for step in range(steps):
        out = model(X)
        positive = out[out > 0]  # planted: a data-dependent shape: a host sync
        loss = positive.square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
