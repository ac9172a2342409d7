"""A per-step `.item()` on CUDA (the textbook's warning): the host waits for the GPU every step.

Each step first does 4 ms of host-side work (standing in for reading and augmenting a batch),
then about 8 ms of GPU work (a 3-layer MLP in fp32): twice the host work. Without a sync, the
host prepares step k+1 while the GPU runs step k, and a step takes ~8 ms; the `.item()` in the
print makes them take turns instead (~12 ms), so the GPU idles a third of each step. gpulab
profile must report host_sync at the print line.

Measure, then size. One step of a fixed batch takes 20x longer on a T4 than on a B200, so a
fixed batch leaves the host work dominating on a fast card (the sync then hides behind it) and
the GPU work dominating everything on a slow one. Before the loop the script runs one warm-up
step and one step whose forward and backward it times with CUDA events, both at 4096 rows, and
sets the batch to 4096 x 8 ms / (the timed part), rounded to 32 rows, between 64 and 16384. These
two steps are the run's first two optimizer steps: the ones a profiler leaves out as warm-up
(gpulab: 2); the wait for the timed part comes before the second one ends, so the loop's first
step starts with an idle GPU.

Why 8 ms: what the sync costs is the GPU's idle time it causes - at most the host work, 4 ms of
a step of 4 + G ms for G ms of GPU work. It outweighs the Python between the calls only while G
is more than the host work (with G = 2 ms, a fixed batch on a fast card, the host work is the
larger cost), and it stays >= 20% of the step only while G is under 4x the host work (16 ms).
8 ms sits in the middle of that range: the sizing may miss by a third either way and still plant
the same cause.

The arithmetic: a step is ~168 MFLOP per row (forward: two 4096x4096 layers, 2 x 33.6 MFLOP;
backward: three matmuls of that size - the first layer needs no input gradient - 100.7 MFLOP;
the 4096x10 layer is negligible), plus an SGD update of 33.6 M parameters (~0.4 GB of memory
traffic, the same at any batch):
  T4    fp32 ~4.5 TFLOPS sustained, 320 GB/s: 4096 rows ~155 ms -> 224 rows, whose step is
        ~8.4 ms of matmuls + ~1.5 ms of update (the update does not shrink with the batch, so
        a slow card lands a little above 8 ms: the GPU still idles a quarter of the step);
  H100  measured ~7 ms at 2048 rows (~49 TFLOPS): 4096 rows ~14 ms -> 2336 rows;
  B200  fp32 ~75 TFLOPS peak, ~55 sustained: 4096 rows ~12.5 ms -> 2624 rows.
Memory stays small: 16384 rows (the cap) keep ~0.8 GB of inputs and saved activations (~1.3 GB
at the peak of backward), and the weights and gradients are 0.27 GB - far inside a 16 GB T4.

At the end it prints, once, what it measured itself (medians over the loop's steps: CUDA events
around each step's GPU work, perf_counter around the host work and the whole step):
  TRUTH script item_every_step.py gpu_ms_per_step 8.1 host_ms_per_step 4.1 step_ms 12.6 steps 60 rows 2336 ...
"""

import statistics
import sys
import time
from contextlib import contextmanager

import torch
from torch import nn

HOST_WORK_S = 0.004  # per step, on the host
TARGET_GPU_MS = 8.0  # per step, on the GPU: twice the host work
FEATURES = 4096
BASE_ROWS, MIN_ROWS, MAX_ROWS, ROW_STEP = 4096, 64, 16384, 32


def prepare_batch_on_host(X: torch.Tensor) -> torch.Tensor:
    time.sleep(HOST_WORK_S)  # host-side work per step: decoding, augmentation, bookkeeping
    return X


def model_and_optimizer(device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.ReLU(), nn.Linear(FEATURES, FEATURES), nn.ReLU(),
                          nn.Linear(FEATURES, 10)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=1e-3)


def random_batch(rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(rows, FEATURES, device=device), torch.randint(0, 10, (rows,), device=device)


def loss_and_gradients(model: nn.Module, optimizer: torch.optim.Optimizer, X: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """A step's forward and backward, queued (nothing here waits for the GPU): the loss, on the GPU."""
    loss = nn.functional.cross_entropy(model(X), y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss


def rows_for_target(model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device) -> tuple[int, float]:
    """Measure, then size: the batch rows whose step takes TARGET_GPU_MS on this GPU, and the
    measured GPU time of a step's forward and backward at BASE_ROWS. That time grows linearly
    with the rows (large matmuls), so one timed step at a known size is enough."""
    X, y = random_batch(BASE_ROWS, device)
    loss_and_gradients(model, optimizer, X, y)  # warm-up: cuBLAS handles, the allocator's first blocks
    optimizer.step()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    loss_and_gradients(model, optimizer, X, y)
    end.record()
    end.synchronize()
    # The update is left out of the timed part so that the wait comes before the step ends: the
    # next step (a profiler's first measured one) starts with nothing queued on the GPU. It is
    # ~0.4 GB of memory traffic, ~1% of a 4096-row step on any card.
    optimizer.step()
    base_ms = start.elapsed_time(end)
    rows = round(BASE_ROWS * TARGET_GPU_MS / base_ms / ROW_STEP) * ROW_STEP
    return min(MAX_ROWS, max(MIN_ROWS, rows)), base_ms


class StepClock:
    """The script's own measurements, read once at the end: the events are only read after the
    last step (reading one before the GPU reached it would wait for the GPU)."""

    def __init__(self):
        self.host_s: list[float] = []
        self.gpu_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.step_ends = [time.perf_counter()]

    @contextmanager
    def host(self):
        t0 = time.perf_counter()
        yield
        self.host_s.append(time.perf_counter() - t0)

    @contextmanager
    def gpu(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        yield
        end.record()
        self.gpu_events.append((start, end))

    def step_done(self) -> None:
        self.step_ends.append(time.perf_counter())

    def truth(self, script: str, **sizing) -> str:
        torch.cuda.synchronize()  # every event has been reached (the per-step .item() did it already)
        gpu_ms = statistics.median(start.elapsed_time(end) for start, end in self.gpu_events)
        host_ms = statistics.median(self.host_s) * 1e3
        step_ms = statistics.median(b - a for a, b in zip(self.step_ends, self.step_ends[1:])) * 1e3
        extra = " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in sizing.items())
        return (f"TRUTH script {script} gpu_ms_per_step {gpu_ms:.1f} host_ms_per_step {host_ms:.1f} "
                f"step_ms {step_ms:.1f} steps {len(self.gpu_events)} {extra}")


def main(steps: int = 60) -> None:
    if not torch.cuda.is_available():
        sys.exit("item_every_step.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda")
    model, optimizer = model_and_optimizer(device)
    rows, base_ms = rows_for_target(model, optimizer, device)
    X, y = random_batch(rows, device)
    clock = StepClock()
    for step in range(steps):
        with clock.host():
            batch = prepare_batch_on_host(X)
        with clock.gpu():
            loss = loss_and_gradients(model, optimizer, batch, y)
            optimizer.step()
        print(f"step {step}: loss {loss.item():.4f}")  # planted: a host sync every step
        clock.step_done()
    print(clock.truth("item_every_step.py", rows=rows, base_rows=BASE_ROWS, base_gpu_ms=base_ms), flush=True)


if __name__ == "__main__":
    main()
