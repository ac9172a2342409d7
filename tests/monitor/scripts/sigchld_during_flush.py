"""Planted: SIGTERM arrives, and children keep dying while gpulab writes the recording.

What a DataLoader does when the job's process group gets SIGTERM: its workers die too, and its
SIGCHLD handler raises "worker killed" in the main thread, wherever that thread is - inside the
profiler's flush, if SIGTERM came first. Here a shell child sends this process SIGTERM and, 5 ms
later (the flush of 2000 steps takes ~25 ms), SIGCHLD as fast as it can until the process is gone:
a process of its own needs no GIL to keep them coming. The handler raises as DataLoader's does.
The run must still end with 143 and every step recorded.
"""

import signal
import subprocess
import time

import torch
from torch import nn

STEPS = 2000  # most still in memory when SIGTERM comes (the helper thread writes every 0.25 s)


def worker_killed(signum, frame):
    raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated.")


def main():
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    signal.signal(signal.SIGCHLD, worker_killed)
    subprocess.Popen(["sh", "-c", 'kill -TERM $PPID; sleep 0.005; while kill -CHLD $PPID 2>/dev/null; do :; done'])
    time.sleep(30)


if __name__ == "__main__":
    main()
