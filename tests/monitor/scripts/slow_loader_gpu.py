"""An input-bound GPU loop: each sample takes 2 ms to "decode" in the main process (num_workers=0),
the model on the GPU is small, so the GPU waits for every batch. gpulab profile must call this
input_pipeline, pointing into __getitem__, and find no host sync (the loop has none).

Not sized from the device: the cause dominates on any card. A batch of 16 samples costs 32 ms of
sleeping on the host whatever the GPU. The GPU's part of a step is a 1024-1024-10 MLP (1.06 M
parameters) on 16 rows: 3 x 2 x 16 x 1.06 M = 0.1 GFLOP (0.02 ms even on a T4's ~4.5 fp32
TFLOPS) plus an SGD update reading and writing ~13 MB (0.05 ms at a T4's 320 GB/s), and issuing
its ~20 kernels costs the host ~0.3 ms. So the data wait is >= 95% of the step on a T4, and
more on anything faster (measured on an H200: 34.4 ms of a 36.7 ms step).

At the end, once, what it measured itself (perf_counter, medians over the batches: the time
blocked in the loader, and from one batch to the next):
  TRUTH script slow_loader_gpu.py data_ms_per_step 32.9 step_ms 34.0 steps 40
"""

import statistics
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowDataset(Dataset):
    def __len__(self):
        return 640

    def __getitem__(self, i):
        time.sleep(0.002)  # planted: a slow decode / disk read per sample
        return torch.randn(1024), i % 10


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("slow_loader_gpu.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(SlowDataset(), batch_size=16, shuffle=True, pin_memory=True)
    data_s, step_s = [], []
    asked = time.perf_counter()  # when the loop asked the loader for the next batch
    for X, y in loader:
        got = time.perf_counter()
        data_s.append(got - asked)
        X, y = X.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - asked)
        asked = time.perf_counter()
    torch.cuda.synchronize()
    print(f"TRUTH script slow_loader_gpu.py data_ms_per_step {statistics.median(data_s) * 1e3:.1f} "
          f"step_ms {statistics.median(step_s) * 1e3:.1f} steps {len(step_s)}", flush=True)


if __name__ == "__main__":
    main()
