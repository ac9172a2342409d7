"""Planted: no torch.optim at all - a manual SGD update, as word_language_model and regression do.

Steps must be found from backward(): 40 of them (4 epochs x 10 batches), then a no-grad evaluation
that is not a step. `--functional` uses no nn.Module either (tensors and autograd only).
"""

import sys

import torch
from torch import nn


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    functional = "--functional" in sys.argv
    X, y = torch.randn(320, 16), torch.randn(320, 1)
    model = nn.Linear(16, 1)
    w = torch.zeros(16, 1, requires_grad=True)
    for epoch in range(4):
        for i in range(10):
            xb, yb = X[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32]
            out = xb @ w if functional else model(xb)
            loss = ((out - yb) ** 2).mean()
            loss.backward()
            with torch.no_grad():
                params = [w] if functional else list(model.parameters())
                for p in params:
                    p.data.add_(p.grad, alpha=-0.01)  # the manual update
                    p.grad = None
    with torch.no_grad():
        print("manual_sgd: eval loss", float(((model(X) - y) ** 2).mean()))


if __name__ == "__main__":
    main()
