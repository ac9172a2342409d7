"""Planted for the multi-rank profile: a 2-rank DDP job (gloo) of 40 steps.

usage (under torchrun): ddp_ranks.py balanced | slow-data | item | comm-bound | manual-allreduce
  balanced          both ranks alike: no straggler
  slow-data         rank 1's __getitem__ sleeps: rank 1 straggles by data wait, rank 0 waits in backward
  item              rank 1 calls .item() and sleeps a little every step (a host-side straggler)
  comm-bound        a 4M-parameter model on batches of 2: each step's 16 MB gradient allreduce
                    outlasts its computation on both ranks alike (communication-bound, no straggler)
  manual-allreduce  no DDP: the gradients are averaged with dist.all_reduce after backward
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

MODE = sys.argv[1]
RANK = int(os.environ.get("RANK", "0"))


class Samples(Dataset):
    def __len__(self):
        return 40 * (2 if MODE == "comm-bound" else 8)

    def __getitem__(self, i):
        if MODE == "slow-data" and RANK == 1:
            time.sleep(0.002)  # planted: a slow decode on rank 1 only
        return torch.randn(64), i % 4


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if MODE == "comm-bound":
        net = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), *(m for _ in range(3) for m in (nn.Linear(1024, 1024), nn.ReLU())),
                            nn.Linear(1024, 4))
    else:
        net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    model = net if MODE == "manual-allreduce" else DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for X, y in DataLoader(Samples(), batch_size=2 if MODE == "comm-bound" else 8):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        if MODE == "manual-allreduce":
            for p in net.parameters():
                dist.all_reduce(p.grad)  # planted: the gradient average, one collective per parameter
                p.grad /= dist.get_world_size()
        optimizer.step()
        if MODE == "item" and RANK == 1:
            time.sleep(0.01 + 0 * loss.item())  # planted: per-step host work on rank 1
    dist.barrier()  # no rank tears gloo down while another still talks to it (an abort at exit, seen once in CI)
    dist.destroy_process_group()
    print(f"ddp_ranks: rank {RANK} done")


if __name__ == "__main__":
    main()
