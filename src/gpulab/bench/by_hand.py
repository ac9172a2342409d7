"""The script a user would otherwise write: the fastest plain-PyTorch LeNet an expert writes by hand
in one file, trained with gpulab's recipe. `gpulab bench training` runs it beside `gpulab train`
to show that gpulab is no slower and no less accurate than doing it yourself.

What the expert does, as one would without gpulab:
  - reads the IDX files with gzip and numpy, and keeps the whole dataset on the device, standardised
    once (with Fashion-MNIST's published mean and std, as gpulab does); batches are a shuffled index into it, so no DataLoader and no per-sample Python;
  - torch's own layers (nn.Sequential), channels_last, bf16 autocast where the device computes bf16
    natively (on a CPU, what oneDNN says it supports), PyTorch's default initialisation;
  - the recipe of `gpulab train`'s default (config.RECIPES["modern"]): SGD with Nesterov momentum
    0.9 and weight decay 5e-4, label smoothing 0.1, a learning rate warmed up linearly over the
    first 15% of the steps to 0.1 and then cosine-annealed to 0, batch 256, the last partial batch
    dropped;
  - on a GPU, the whole step (forward, backward, the fused SGD update) recorded once as a CUDA graph
    after three eager steps, and replayed (torch's notes on whole-network capture);
  - evaluation on the device, the hits summed there and read once per epoch.

It imports nothing of gpulab's: run it by its path, as a user runs their script.

    python by_hand.py EPOCHS DEVICE DATA_DIR   -> one JSON line, as gpulab.bench.textbook prints:
    per epoch (lists) the training and evaluation seconds, the test accuracy and `wall_s`, the
    seconds since this process was created when that epoch's evaluation ended; and `first_step_s`,
    when the first training step had finished on the device.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

BATCH, EVAL_BATCH = 256, 1024
PEAK_LR, MOMENTUM, WEIGHT_DECAY, LABEL_SMOOTHING, WARMUP_FRAC = 0.1, 0.9, 5e-4, 0.1, 0.15
MEAN, STD = 0.2860, 0.3530  # Fashion-MNIST's training images, as published
EAGER_STEPS_BEFORE_RECORDING = 3


def seconds_since_start() -> float:
    """Wall seconds since this process was created (Linux: both ends counted from boot). Only the
    measurement: the training needs none of it."""
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")


def read_idx(folder: Path, name: str) -> np.ndarray:
    """An IDX file (gzipped or not): a big-endian header of dims, then uint8 data."""
    path = folder / f"{name}.gz"
    raw = gzip.decompress(path.read_bytes()) if path.exists() else (folder / name).read_bytes()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * dims).reshape(shape)


def load(folder: Path, device: torch.device):
    """Both splits on the device, the images standardised once (float32)."""
    splits = []
    for images, labels in (("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                           ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")):
        X = torch.from_numpy(read_idx(folder, images).copy()).to(device).unsqueeze(1).float().div_(255)
        y = torch.from_numpy(read_idx(folder, labels).astype(np.int64)).to(device)
        splits.append((X, y))
    return [(X.sub_(MEAN).div_(STD), y) for X, y in splits]


def lenet() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(1, 20, kernel_size=3), nn.ReLU(), nn.AvgPool2d(2),
        nn.Conv2d(20, 50, kernel_size=5), nn.ReLU(), nn.AvgPool2d(2),
        nn.Flatten(), nn.Linear(800, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def lr_at(step: int, total: int) -> float:
    warmup = int(WARMUP_FRAC * total)
    if step < warmup:
        return PEAK_LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return PEAK_LR * 0.5 * (1 + math.cos(math.pi * progress))


def sgd(model: nn.Module, device: torch.device) -> torch.optim.SGD:
    """On a GPU the fused update, whose learning rate may be a tensor on the device: a recorded step
    reads it there, where a float would be recorded once and never change."""
    on_gpu = device.type == "cuda"
    return torch.optim.SGD(model.parameters(), lr=torch.tensor(PEAK_LR, device=device) if on_gpu else PEAK_LR,
                           momentum=MOMENTUM, nesterov=True, weight_decay=WEIGHT_DECAY, fused=on_gpu or None)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for group in opt.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr)  # on the device, where the recorded step reads it
        else:
            group["lr"] = lr


class Step:
    """One training step on a batch; on a GPU recorded as a CUDA graph after a few eager steps."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device, dtype):
        self.model, self.opt, self.device, self.dtype = model, opt, device, dtype
        self.record = device.type == "cuda"
        self.eager_steps = 0
        self.graph = None
        if self.record:
            self.stream = torch.cuda.Stream()

    def eager(self, X: torch.Tensor, y: torch.Tensor) -> None:
        # A recorded graph must not use autocast's cache of cast weights: it would replay stale casts.
        with torch.autocast(self.device.type, self.dtype, enabled=self.dtype is not None, cache_enabled=False):
            loss = F.cross_entropy(self.model(X), y, label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        self.opt.step()

    def __call__(self, X: torch.Tensor, y: torch.Tensor) -> None:
        if not self.record:
            self.opt.zero_grad(set_to_none=True)
            self.eager(X, y)
        elif self.eager_steps < EAGER_STEPS_BEFORE_RECORDING:  # on a side stream, as torch's notes ask
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.opt.zero_grad(set_to_none=True)
                self.eager(X, y)
            torch.cuda.current_stream().wait_stream(self.stream)
            self.eager_steps += 1
        elif self.graph is None:
            self.X, self.y = X.clone(), y.clone()
            self.opt.zero_grad(set_to_none=True)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):  # recorded, not run: the replay below runs it
                self.eager(self.X, self.y)
            self.graph.replay()
        else:
            self.X.copy_(X)
            self.y.copy_(y)
            self.graph.replay()


@torch.no_grad()
def accuracy(model: nn.Module, X: torch.Tensor, y: torch.Tensor, dtype) -> float:
    model.eval()
    hits = torch.zeros((), dtype=torch.int64, device=X.device)
    with torch.autocast(X.device.type, dtype, enabled=dtype is not None):
        for i in range(0, len(y), EVAL_BATCH):
            hits += (model(X[i:i + EVAL_BATCH]).argmax(1) == y[i:i + EVAL_BATCH]).sum()
    model.train()
    return hits.item() / len(y)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(epochs: int, device_spec: str, data_dir: str) -> dict:
    torch.manual_seed(0)
    device = torch.device(device_spec)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    (X_train, y_train), (X_test, y_test) = load(Path(data_dir), device)
    dtype = torch.bfloat16 if native_bf16(device) else None
    model = lenet().to(device, memory_format=torch.channels_last)
    opt = sgd(model, device)
    step = Step(model, opt, device, dtype)
    steps_per_epoch = len(y_train) // BATCH
    total = epochs * steps_per_epoch
    train_s, eval_s, test_acc, wall_s, first_step_s = [], [], [], [], None
    for epoch in range(epochs):
        t0 = time.perf_counter()
        order = torch.randperm(len(y_train), device=device)
        for i in range(steps_per_epoch):
            batch = order[i * BATCH:(i + 1) * BATCH]
            set_lr(opt, lr_at(epoch * steps_per_epoch + i, total))
            step(X_train[batch].contiguous(memory_format=torch.channels_last), y_train[batch])
            if first_step_s is None:
                synchronize(device)
                first_step_s = seconds_since_start()
        synchronize(device)
        t1 = time.perf_counter()
        test_acc.append(accuracy(model, X_test, y_test, dtype))
        train_s.append(t1 - t0)
        eval_s.append(time.perf_counter() - t1)
        wall_s.append(seconds_since_start())
    return {"train_seconds": train_s, "eval_seconds": eval_s, "test_acc": test_acc, "wall_s": wall_s,
            "first_step_s": first_step_s}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2], sys.argv[3])))
