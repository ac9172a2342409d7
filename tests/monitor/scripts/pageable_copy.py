"""Every step copies a 64 MiB batch to the GPU from pageable (not pinned) memory, blocking.

The model is tiny, so the copy is most of the step. gpulab profile must report h2d_copy at the
copy line.

Not sized from the device: the cause dominates on any PCIe card. 4096 x 4096 floats are 67.1 MB;
PCIe x16 moves at most 15.8 GB/s (gen3: T4), 31.5 (gen4: A100 PCIe, L4) or 63 (gen5: H100,
H200, B200), so the copy takes at least 4.3 / 2.1 / 1.1 ms - and from pageable memory the driver
stages it through a pinned buffer at a fraction of that (measured on an H200: 8.8 ms, 7.6 GB/s).
The GPU's part of the step is a 4096x10 layer on 4096 rows: 0.7 GFLOP and two reads of the
67 MB batch, 0.4 ms at a T4's 320 GB/s and ~0.02 ms on an H100 or B200; issuing the step's ~15
kernels costs the host ~0.3 ms. So the copy is >= 4.3 / (4.3 + 0.4 + 0.3) = 86% of the step on
a T4 and >= 1.1 / (1.1 + 0.02 + 0.3) = 77% on a B200 even at the link's full speed. (Where the
GPU is attached by NVLink-C2C - GH200, GB200 - a copy can run at ~400 GB/s and the share drops
to about a third; such a host is not a PCIe card and is not what this script plants.)

At the end, once, what it measured itself (perf_counter, medians over the steps; the copy is
the time the host was blocked in the copy call):
  TRUTH script pageable_copy.py copy_ms_per_step 8.8 step_ms 10.1 copy_mb 67.1 steps 30
"""

import statistics
import sys
import time

import torch
from torch import nn


def main(steps: int = 30) -> None:
    if not torch.cuda.is_available():
        sys.exit("pageable_copy.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(4096, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    host_batches = [torch.randn(4096, 4096) for _ in range(2)]  # pageable: never pinned
    y = torch.randint(0, 10, (4096,), device=device)
    copy_s, step_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        X = host_batches[step % 2].to(device)  # planted: a blocking copy from pageable memory
        copy_s.append(time.perf_counter() - t0)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"TRUTH script pageable_copy.py copy_ms_per_step {statistics.median(copy_s) * 1e3:.1f} "
          f"step_ms {statistics.median(step_s) * 1e3:.1f} copy_mb {host_batches[0].nbytes / 1e6:.1f} steps {steps}",
          flush=True)


if __name__ == "__main__":
    main()
