"""Fails after a few steps: by an exception (exit 1), or with `--exit N` by sys.exit(N)."""

import sys

import torch
from torch import nn


def main():
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(32, 8), torch.randint(0, 2, (32,))
    for step in range(8):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"failing: step {step}")
        if step == 5:
            print("failing: about to stop", file=sys.stderr)
            if "--exit" in sys.argv:
                sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
            raise RuntimeError("planted failure")


if __name__ == "__main__":
    main()
