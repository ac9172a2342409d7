"""Boolean-mask indexing on CUDA: the result's size depends on the data, so the host must wait.

torch reports this sync (sync debug mode) inside a call gpulab does not wrap; gpulab profile
must still list it at the indexing line, once per step.

Not sized from the device: what is planted is where a sync happens, not how long it lasts.
`out[out > 0]` must read the mask's count back to the host before it can allocate the result,
on every card and every step (20 steps: 20 syncs at that line), whatever the GPU's speed.

At the end, once, what it measured itself (perf_counter, medians over the steps: the indexing
call, which includes the wait, and the whole step):
  TRUTH script masked_index.py mask_ms_per_step 0.1 step_ms 1.8 syncs_per_step 1 steps 20
"""

import statistics
import sys
import time

import torch
from torch import nn


def main(steps: int = 20) -> None:
    if not torch.cuda.is_available():
        sys.exit("masked_index.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = nn.Linear(256, 256).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    X = torch.randn(512, 256, device=device)
    mask_s, step_s = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        out = model(X)
        t_mask = time.perf_counter()
        positive = out[out > 0]  # planted: a data-dependent shape: a host sync
        mask_s.append(time.perf_counter() - t_mask)
        loss = positive.square().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step_s.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    print(f"TRUTH script masked_index.py mask_ms_per_step {statistics.median(mask_s) * 1e3:.2f} "
          f"step_ms {statistics.median(step_s) * 1e3:.2f} syncs_per_step 1 steps {steps}", flush=True)


if __name__ == "__main__":
    main()
