"""The whole step inside `torch.profiler.record_function`, as users do to find it in a trace.

An annotation appears on the GPU track too (a `gpu_user_annotation` spanning the step's first to
last kernel); counted as a kernel it would fill every idle gap and read ~100% busy. The step
itself is item_every_step.py's, imported from there so that the two cannot drift apart: 4 ms of
host work, then about 8 ms of GPU work, and a `.item()` that makes the two take turns, so the
GPU idles about a third of each step. gpulab profile must still report host_sync at the print
line and a device busy share within a few points of item_every_step.py's.

Measure, then size, as item_every_step.py does (its docstring has the arithmetic for a T4, an
H100 and a B200): a warm-up step and a step timed with CUDA events at 4096 rows, then the batch
scaled to 8 ms of GPU work per step on this card. At the end, once, what it measured itself:
  TRUTH script annotated_step.py gpu_ms_per_step 8.1 host_ms_per_step 4.1 step_ms 12.6 steps 60 rows 2336 ...
"""

import sys

import torch
from torch.profiler import record_function

from item_every_step import (BASE_ROWS, StepClock, loss_and_gradients, model_and_optimizer, prepare_batch_on_host,
                             random_batch, rows_for_target)


def main(steps: int = 60) -> None:
    if not torch.cuda.is_available():
        sys.exit("annotated_step.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model, optimizer = model_and_optimizer(device)
    rows, base_ms = rows_for_target(model, optimizer, device)
    X, y = random_batch(rows, device)
    clock = StepClock()
    for step in range(steps):
        with record_function("train_step"):
            with clock.host():
                batch = prepare_batch_on_host(X)
            with clock.gpu():
                loss = loss_and_gradients(model, optimizer, batch, y)
                optimizer.step()
            print(f"step {step}: loss {loss.item():.4f}")  # planted: a host sync every step
            clock.step_done()
    print(clock.truth("annotated_step.py", rows=rows, base_rows=BASE_ROWS, base_gpu_ms=base_ms), flush=True)


if __name__ == "__main__":
    main()
