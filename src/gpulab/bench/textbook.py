"""The textbook's multi-GPU chapter, ported to PyTorch as the chapter writes it: the reference
that gpulab train is measured against (`gpulab bench training`, benchmarks/train_speed.py).

  - a per-sample Dataset (uint8 -> float/255, as ToTensor does) batched by a DataLoader with 4
    workers, shuffled, started again each epoch;
  - the functional LeNet over a list of parameter tensors, N(0, 0.01^2) init;
  - per-device loss.sum().backward(), the chapter's allreduce (copy-add to device 0, copy back),
    and its sgd: p -= lr * grad / batch (lr 0.2), the device synchronized after every batch;
  - evaluation after every epoch, one batch at a time, reading each batch's hits to the host.

    python -m gpulab.bench.textbook EPOCHS DEVICE [DATA_DIR]   -> one JSON line, per epoch (lists): the training
    seconds and the evaluation seconds (timed apart), the test accuracy, and `wall_s`, the seconds
    since this process was created when that epoch's evaluation ended; and `first_step_s`, the
    seconds since the process was created when its first training batch had finished on the
    device - the same figures `gpulab train` writes in its metrics.json
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from gpulab import data
from gpulab.devices import resolve, synchronize
from gpulab.host import seconds_since_start

BATCH = 256
LR = 0.2
WORKERS = 4


def params(device: torch.device) -> list[torch.Tensor]:
    scale = 0.01
    shapes = [(20, 1, 3, 3), (20,), (50, 20, 5, 5), (50,), (800, 128), (128,), (128, 10), (10,)]
    weights = [torch.randn(s) * scale if len(s) > 1 else torch.zeros(s) for s in shapes]
    return [w.to(device).requires_grad_() for w in weights]


def lenet(X: torch.Tensor, W: list[torch.Tensor]) -> torch.Tensor:
    h1 = F.avg_pool2d(F.relu(F.conv2d(X, W[0], W[1])), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, W[2], W[3])), kernel_size=2, stride=2)
    h3 = F.relu(torch.mm(h2.reshape(h2.shape[0], -1), W[4]) + W[5])
    return torch.mm(h3, W[6]) + W[7]


def allreduce(tensors: list[torch.Tensor]) -> None:
    for i in range(1, len(tensors)):
        tensors[0][:] += tensors[i].to(tensors[0].device)
    for i in range(1, len(tensors)):
        tensors[i][:] = tensors[0].to(tensors[i].device)


def train_batch(X: torch.Tensor, y: torch.Tensor, device_params: list[list[torch.Tensor]],
                devices: list[torch.device], lr: float) -> None:
    X_shards = torch.nn.parallel.scatter(X, devices) if devices[0].type == "cuda" else [X]
    y_shards = torch.nn.parallel.scatter(y, devices) if devices[0].type == "cuda" else [y]
    losses = [F.cross_entropy(lenet(Xs, W), ys, reduction="none").sum()
              for Xs, ys, W in zip(X_shards, y_shards, device_params)]
    for loss in losses:
        loss.backward()
    with torch.no_grad():
        for i in range(len(device_params[0])):
            allreduce([device_params[c][i].grad for c in range(len(devices))])
    for W in device_params:
        with torch.no_grad():
            for p in W:
                p -= lr * p.grad / X.shape[0]
                p.grad.zero_()


def accuracy(test_iter: DataLoader, W: list[torch.Tensor], device: torch.device) -> float:
    correct = total = 0
    with torch.no_grad():
        for X, y in test_iter:
            correct += (lenet(X.to(device), W).argmax(1) == y.to(device)).sum().item()
            total += len(y)
    return correct / total


def main(epochs: int, device_spec: str, data_dir: str | None = None) -> dict:
    torch.manual_seed(0)
    device = resolve(device_spec)[0]
    train_split, test_split = data.load(data_dir)
    W = params(device)
    train_iter = DataLoader(data.ImageDataset(train_split), BATCH, shuffle=True, num_workers=WORKERS)
    test_iter = DataLoader(data.ImageDataset(test_split), BATCH, num_workers=WORKERS)
    train_s, eval_s, test_acc, wall_s, first_step_s = [], [], [], [], None
    for _ in range(epochs):
        t0 = time.perf_counter()
        for X, y in train_iter:
            train_batch(X.to(device), y.to(device), [W], [device], LR)
            synchronize([device])  # the chapter waits for every batch
            if first_step_s is None:  # what a user waited for training to begin (synchronized above)
                first_step_s = seconds_since_start()
        t1 = time.perf_counter()
        test_acc.append(accuracy(test_iter, W, device))
        # timed apart, as gpulab train's metrics time training and evaluation
        train_s.append(t1 - t0)
        eval_s.append(time.perf_counter() - t1)
        wall_s.append(seconds_since_start())  # as gpulab train's rows: when this accuracy was known
    return {"train_seconds": train_s, "eval_seconds": eval_s, "test_acc": test_acc, "wall_s": wall_s,
            "first_step_s": first_step_s}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], *sys.argv[3:4])))
