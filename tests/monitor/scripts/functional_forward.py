"""Planted: a model written with torch functions over a list of weights - no nn.Module, as the
textbook's multi-GPU chapter writes LeNet - trained with torch.optim. Its forward is compute,
though no module's forward runs. The script times its own forward and, with --python, a planted
per-step Python loop, and writes their shares of the step to a JSON file.

usage: functional_forward.py TRUTH.json [--python]
"""

import json
import sys
import time

import torch
import torch.nn.functional as F

STEPS = 120


def forward(X, W):
    h = F.max_pool2d(F.relu(F.conv2d(X, W[0], W[1], padding=1)), 2)
    h = F.relu(torch.mm(h.reshape(h.shape[0], -1), W[2]) + W[3])
    return torch.mm(h, W[4]) + W[5]


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    shapes = [(16, 3, 3, 3), (16,), (16 * 16 * 16, 64), (64,), (64, 10), (10,)]
    W = [(torch.randn(s) * 0.05).requires_grad_() for s in shapes]
    optimizer = torch.optim.SGD(W, lr=0.01)
    X, y = torch.randn(64, 3, 32, 32), torch.randint(0, 10, (64,))
    with_python = "--python" in sys.argv
    forward_s = python_s = 0.0
    t0 = time.perf_counter()
    for _ in range(STEPS):
        t = time.perf_counter()
        loss = F.cross_entropy(forward(X, W), y)
        forward_s += time.perf_counter() - t
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if with_python:
            t = time.perf_counter()
            sum(i * i for i in range(80_000))  # planted: Python in every step
            python_s += time.perf_counter() - t
    total = time.perf_counter() - t0
    with open(sys.argv[1], "w") as f:
        json.dump({"forward": forward_s / total, "python": python_s / total}, f)


if __name__ == "__main__":
    main()
