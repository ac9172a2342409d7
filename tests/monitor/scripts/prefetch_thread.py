"""Planted: batches prefetched by a thread of the script's own (as prefetch_generator's
BackgroundGenerator does) from a DataLoader without workers whose samples take 3 ms each to read;
the loop takes them from a queue and trains ~2 ms a step.

gpulab profile must call the wait at the queue an input pipeline - the DataLoader in the other
thread is what the loop waits for - not a wait to move to a background thread. The script prints
the seconds it waited at the queue and its loop's seconds, by its own clock.
"""

import queue
import threading
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowReads(Dataset):
    def __len__(self):
        return 320

    def __getitem__(self, i):
        time.sleep(0.003)  # a slow read per sample
        return torch.randn(64), i % 4


def prefetch(loader: DataLoader, batches: queue.Queue) -> None:
    for batch in loader:
        batches.put(batch)
    batches.put(None)


def main():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches: queue.Queue = queue.Queue(maxsize=2)
    threading.Thread(target=prefetch, args=(DataLoader(SlowReads(), batch_size=8), batches), daemon=True).start()
    waited_s = 0.0
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        batch = batches.get()  # planted: the loop waits for the prefetching thread
        waited_s += time.perf_counter() - t0
        if batch is None:
            break
        X, y = batch
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"prefetch_thread: waited {waited_s:.2f} s of {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
