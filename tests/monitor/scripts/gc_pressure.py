"""A training loop under garbage-collection pressure, with helper threads alive (issue 33).

On an H200, `gpulab profile` crashed CUDA jobs inside a garbage collection (exit 139) with its
own helper threads alive. Whatever a profiler hangs on a job's tensors - weak references,
finalizers, Python objects attached to their storages - meets the collector and other threads
here as often as possible: collections every few allocations (gc.set_threshold), a thread that
makes tensors and collects beside the training, gradients made and freed every step
(zero_grad(set_to_none=True)), many steps.

The script states its own truth, measured by itself after every step: the most weak references
and finalizers that pointed at its parameters, their gradients and its optimizer state at any
step's end (a profiler that reads only what is safe puts none there) and that it trained.

usage: gc_pressure.py [STEPS] [DEVICE]   (DEVICE: cpu, the default, or cuda: the same loop on the GPU)
"""

import gc
import sys
import threading
import weakref

import torch
from torch import nn


def churn(stop: threading.Event) -> None:
    """Another thread: tensors made and dropped, collections forced."""
    while not stop.is_set():
        kept = [torch.randn(64) for _ in range(32)]
        del kept
        gc.collect()
        stop.wait(0.002)


def finalizers_on_tensors() -> int:
    return sum(isinstance(info.weakref(), torch.Tensor) for info in list(weakref.finalize._registry.values()))


def held_on(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """(weak references on the training's tensors, finalizers on any tensor), right now."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    return sum(weakref.getweakrefcount(t) for t in tensors), finalizers_on_tensors()


def main(steps: int, device: str) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    gc.set_threshold(25, 5, 5)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10)).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    X, y = torch.randn(512, 64, device=device), torch.randint(0, 10, (512,), device=device)
    stop = threading.Event()
    helper = threading.Thread(target=churn, args=(stop,), name="churn")
    helper.start()
    first = last = None
    most_weakrefs = most_finalizers = 0
    try:
        for step in range(steps):
            i = (step * 32) % 512
            loss = nn.functional.cross_entropy(model(X[i:i + 32]), y[i:i + 32])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            first = loss.item() if first is None else first
            last = loss.item()
            weakrefs, finalizers = held_on(model, optimizer)
            most_weakrefs, most_finalizers = max(most_weakrefs, weakrefs), max(most_finalizers, finalizers)
    finally:
        stop.set()
        helper.join()
    print(f"TRUTH steps {steps} most_weakrefs_on_tensors {most_weakrefs} most_finalizers_on_tensors "
          f"{most_finalizers} loss {first:.3f} -> {last:.3f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 120, sys.argv[2] if len(sys.argv) > 2 else "cpu")
