"""Planted for ranks not started by torchrun: a 2-rank DDP job (gloo) started with
torch.multiprocessing.spawn, 40 steps per rank. Neither rank has RANK in its environment: each
learns its rank from the process index mp.spawn passes (init_process_group(rank=...)).

usage: ddp_spawned.py balanced | slow-data
  slow-data  rank 1's __getitem__ sleeps: rank 1 straggles by data wait, rank 0 waits in backward

Each rank prints its truth: its rank from torch.distributed and the steps it ran.
"""

import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

STEPS, BATCH = 40, 8


class Samples(Dataset):
    def __init__(self, slow: bool):
        self.slow = slow

    def __len__(self):
        return STEPS * BATCH

    def __getitem__(self, i):
        if self.slow:
            time.sleep(0.002)  # planted: a slow decode on rank 1 only
        return torch.randn(64), i % 4


def train(rank: int, world_size: int, mode: str, port: int):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 0
    for X, y in DataLoader(Samples(mode == "slow-data" and rank == 1), batch_size=BATCH):
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps += 1
    dist.barrier()  # no rank tears gloo down while another still talks to it
    # one write per line: both ranks print at once
    truth = f"rank {dist.get_rank()} steps {steps} pid {os.getpid()} RANK {os.environ.get('RANK')}"
    print(f"ddp_spawned: {truth}\n", end="", flush=True)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    mp.spawn(train, args=(2, sys.argv[1], free_port()), nprocs=2)
