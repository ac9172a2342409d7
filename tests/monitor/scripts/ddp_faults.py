"""Planted faults in a 2-rank DDP job (gloo) of 60 steps; each fault happens on rank 1 at step 20.

usage (under torchrun): ddp_faults.py hang | eval | mismatch | raise | kill | stop | stall
  hang      rank 1 skips one all_reduce: rank 0 waits in it, rank 1 goes on to the final barrier;
            both block inside gloo, where a Python signal handler never runs
  eval      no fault: after step 20 rank 0 alone evaluates for EVAL_S (forward calls, no step, no
            collective; default 8 s) while rank 1 waits in a barrier - a common pattern, and no hang
  mismatch  rank 1's all_reduce is of 2 elements, rank 0's of 1 (gloo aborts the collective)
  raise     rank 1 raises a RuntimeError
  kill      rank 1 sends itself SIGKILL (as the kernel's out-of-memory killer would)
  crash     rank 1 reads address 0 (a segmentation fault, as a broken extension would)
  stop      rank 1 sends itself SIGSTOP (Ctrl-Z, a debugger): alive, but never comes back
  stall     rank 1 sleeps STALL_S inside step 20 (before backward), then the job goes on

Each rank writes `<FAULT_DIR>/rank<r>-at-fault` as it reaches the fault, so a test knows when the
job is in it.
"""

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

MODE = sys.argv[1]
RANK = int(os.environ.get("RANK", "0"))
FAULT_STEP = 20
EVAL_S = float(os.environ.get("EVAL_S", "8"))
STALL_S = float(os.environ.get("STALL_S", "30"))
STEP_S = 0.02  # each step's own time (a sleep): long enough that every rank's steps reach its recording


def at_fault() -> None:
    folder = os.environ.get("FAULT_DIR")
    if folder:
        Path(folder, f"rank{RANK}-at-fault").touch()


def plant(mode: str) -> None:
    """The faults that happen in place (rank 1, at step FAULT_STEP)."""
    if mode == "raise":
        raise RuntimeError("planted failure on rank 1")
    if mode == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode == "crash":
        ctypes.string_at(0)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    total = torch.zeros(1)
    for step in range(60):
        X, y = torch.randn(8, 64), torch.randint(0, 4, (8,))
        loss = nn.functional.cross_entropy(model(X), y)
        time.sleep(STEP_S)
        if MODE == "stall" and RANK == 1 and step == FAULT_STEP:
            time.sleep(STALL_S)  # planted: inside the step; rank 0 waits in DDP's allreduce in backward
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == FAULT_STEP:
            at_fault()
            if RANK == 1:
                plant(MODE)
            if MODE == "hang" and RANK == 1:
                break  # planted: rank 1 skips the all_reduce below and waits in the barrier
        if MODE == "mismatch" and RANK == 1 and step == FAULT_STEP:
            dist.all_reduce(torch.zeros(2))  # planted: 2 elements where rank 0 sends 1
        dist.all_reduce(total)
        if MODE == "eval" and step == FAULT_STEP:
            if RANK == 0:
                with torch.no_grad():
                    until = time.monotonic() + EVAL_S
                    while time.monotonic() < until:
                        model.module(torch.randn(8, 64))
                        time.sleep(0.01)
            dist.barrier()  # rank 1 waits here while rank 0 evaluates
    dist.barrier()
    dist.destroy_process_group()
    print(f"ddp_faults: rank {RANK} done")


if __name__ == "__main__":
    main()
