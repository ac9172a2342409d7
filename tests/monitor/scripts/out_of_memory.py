"""Planted: the third step runs out of memory. Two steps of batch 64, then the script limits its
own address space (RLIMIT_AS) to what it uses plus 300 MB and trains on a batch of 16384: the
first layer's output (128 MB) fits, and a later layer's does not.
Activations are then the largest thing in use (256 MB; parameters 19 MB, Adam 38 MB).

usage: out_of_memory.py [--in-child | --cuda | --first-step]   (--in-child: the training runs in a
forked child process; --cuda: on the GPU, the caching allocator limited the same way;
--first-step: the large batch comes first, so no step ends)"""

import multiprocessing as mp
import resource
import sys

import torch
from torch import nn


def address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def limit_memory(device: str) -> None:
    """From now on at most 300 MB more: of address space on a CPU, of the caching allocator on CUDA."""
    if device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + 300 * 2**20) / total)
    else:
        limit = address_space() + 300 * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(device: str = "cpu", batches: tuple[int, ...] = (64, 64, 16384)):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 10))
    model = model.to(device)
    optimizer = torch.optim.Adam(model.parameters())
    for batch in batches:
        X, y = torch.randn(batch, 256, device=device), torch.randint(0, 10, (batch,), device=device)
        if batch == batches[-1]:
            limit_memory(device)
        optimizer.zero_grad(set_to_none=True)
        out = model(X)  # planted: runs out of memory here, in a layer of the forward
        nn.functional.cross_entropy(out, y).backward()
        optimizer.step()


if __name__ == "__main__":
    if "--in-child" in sys.argv:
        child = mp.get_context("fork").Process(target=main)
        child.start()
        child.join()
        sys.exit(child.exitcode)
    main("cuda" if "--cuda" in sys.argv else "cpu", (16384,) if "--first-step" in sys.argv else (64, 64, 16384))
