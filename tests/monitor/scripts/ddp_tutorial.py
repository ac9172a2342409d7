"""The DDP tutorial series' multigpu_torchrun.py (pytorch/examples, distributed/ddp-tutorial-series)
on the CPU over gloo: Linear(20, 1) on 2048 random samples, a DataLoader with a
DistributedSampler, batch 32 per rank, DDP, 2 epochs: 32 steps per rank per epoch, each well under
a millisecond. Run it under torchrun with 2 ranks.

It measures its own truth in the same run, and prints it per rank:
  median step   the median time between two ends of optimizer.step() (its own clock)
  DDP wait      the median time from the last gradient's accumulation to the end of backward(),
                where DDP waits for its one bucket's allreduce
  allreduce     the median time of a gloo all_reduce of the model's gradients (21 floats), timed
                after training
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 2


class MyTrainDataset(Dataset):
    def __init__(self, size):
        self.size = size
        self.data = [(torch.rand(20), torch.rand(1)) for _ in range(size)]

    def __len__(self):
        return self.size

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer):
        self.rank = int(os.environ["RANK"])
        self.train_data = train_data
        self.optimizer = optimizer
        self.model = DDP(model)
        self.step_ends: list[float] = []  # the script's own clock
        self.waits: list[float] = []
        self.last_gradient = 0.0
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, param):
        self.last_gradient = time.perf_counter()

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.cross_entropy(output, targets)
        loss.backward()
        self.waits.append(time.perf_counter() - self.last_gradient)
        self.optimizer.step()
        self.step_ends.append(time.perf_counter())

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[rank {self.rank}] Epoch {epoch} | Batchsize: {b_sz} | Steps: {len(self.train_data)}")
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in self.train_data:
            self._run_batch(source, targets)

    def train(self, max_epochs):
        for epoch in range(max_epochs):
            self._run_epoch(epoch)

    def median_step_s(self) -> float:
        ends = self.step_ends
        return statistics.median(b - a for a, b in zip(ends, ends[1:]))


def allreduce_s(model, repeats: int = 50) -> float:
    """One gloo all_reduce of the gradients' size, as DDP's one bucket does it (median)."""
    bucket = torch.zeros(sum(p.numel() for p in model.parameters()))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dist.all_reduce(bucket)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    dataset = MyTrainDataset(2048)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loader = DataLoader(dataset, batch_size=32, pin_memory=False, shuffle=False, sampler=DistributedSampler(dataset))
    trainer = Trainer(model, loader, optimizer)
    trainer.train(EPOCHS)
    comm = allreduce_s(model)
    print(f"ddp_tutorial: rank {trainer.rank} steps {len(trainer.step_ends)} median step "
          f"{trainer.median_step_s() * 1e3:.4f} ms DDP wait {statistics.median(trainer.waits) * 1e3:.4f} ms "
          f"allreduce {comm * 1e3:.4f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
