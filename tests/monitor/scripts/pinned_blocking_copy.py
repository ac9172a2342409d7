"""Pinned host memory, but `.to(device)` without `non_blocking=True`: the copy still blocks.

`pin_memory=True` only makes a copy *able* to run asynchronously; without `non_blocking=True`
the host waits for the copy engine (and so for the work queued before it) every step, exactly as
from pageable memory. The most common half-fix in the lecture notes' input pipelines. gpulab
profile must report h2d_copy at the copy line, naming non_blocking as the fix.

Not sized from the device: the cause dominates on any PCIe card. A pinned copy runs at the
link's speed: 67.1 MB (4096 x 4096 floats) over PCIe x16 at most 15.8 GB/s (gen3: T4), 31.5
(gen4) or 63 (gen5: H100, H200, B200) takes >= 4.3 / 2.1 / 1.1 ms (measured on an H200:
1.3 ms, 52 GB/s). The rest of the step is a 4096x10 layer on 4096 rows (0.4 ms on a T4,
~0.02 ms on an H100 or B200) and ~0.3 ms of host time issuing ~15 kernels, so the blocking copy
is >= 86% of the step on a T4 and >= 77% on a B200 at the link's full speed. (NVLink-C2C hosts -
GH200, GB200 - copy at ~400 GB/s; there the share drops to about a third.)

At the end, once, what it measured itself (perf_counter, medians over the steps; the copy is
the time the host was blocked in the copy call):
  TRUTH script pinned_blocking_copy.py copy_ms_per_step 1.3 step_ms 2.3 copy_mb 67.1 steps 30
"""

import statistics
import sys
import time

import torch
from torch import nn


def main(steps: int = 30) -> None:
    if not torch.cuda.is_available():
        sys.exit("pinned_blocking_copy.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(4096, 10).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    host_batches = [torch.randn(4096, 4096).pin_memory() for _ in range(2)]
    y = torch.randint(0, 10, (4096,), device=device)
    copy_s, step_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        X = host_batches[step % 2].to(device)  # planted: pinned, but blocking (no non_blocking=True)
        copy_s.append(time.perf_counter() - t0)
        loss = nn.functional.cross_entropy(model(X), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"TRUTH script pinned_blocking_copy.py copy_ms_per_step {statistics.median(copy_s) * 1e3:.1f} "
          f"step_ms {statistics.median(step_s) * 1e3:.1f} copy_mb {host_batches[0].nbytes / 1e6:.1f} steps {steps}",
          flush=True)


if __name__ == "__main__":
    main()
