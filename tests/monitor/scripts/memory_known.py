"""Planted: a model trained with Adam whose memory is known - parameters, gradients and Adam's
two moments counted by hand, activations by the script's own saved_tensors_hooks - written to a
JSON file for the test to hold gpulab's memory split against.

usage: memory_known.py mlp|cnn TRUTH.json [cuda]
"""

import json
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STEPS = 8


def model_and_data(kind: str):
    if kind == "mlp":  # parameters dominate (6 MiB, Adam 12 MiB), activations 2 MiB
        model = nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
        return model, TensorDataset(torch.randn(256 * STEPS, 512), torch.randint(0, 10, (256 * STEPS,))), 256
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16 * 16, 10))  # activations dominate (36 MiB)
    return model, TensorDataset(torch.randn(64 * STEPS, 3, 32, 32), torch.randint(0, 10, (64 * STEPS,))), 64


def truth(model: nn.Module, X: torch.Tensor, y: torch.Tensor, data: TensorDataset) -> dict:
    """The sizes by hand, the activations as autograd saves them (one forward and backward), and
    the dataset the script keeps in memory."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params and key != X.untyped_storage().data_ptr():
            saved[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(X), y)
    loss.backward()
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"parameters": n, "gradients": n, "optimizer_state": 2 * n, "activations": sum(saved.values()),
            "inputs": X.nbytes + y.nbytes, "dataset": sum(t.nbytes for t in data.tensors)}


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    model, data, batch = model_and_data(sys.argv[1])
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters())
    for X, y in DataLoader(data, batch_size=batch):
        X, y = X.to(device), y.to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(X), y)
        loss.backward()
        optimizer.step()
    with open(sys.argv[2], "w") as f:
        json.dump(truth(model, X, y, data), f)


if __name__ == "__main__":
    main()
