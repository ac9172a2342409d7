"""The settings of one profiling session (`gpulab profile`, `gpulab.monitor.profile`, `train --profile`)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from gpulab.errors import UserError

TRY_STEPS = 30  # `gpulab profile --try`: steps measured per run, unless --steps says otherwise
TRY_MAX_PAIRS = 5  # and pairs of runs at most (--max-pairs)
# A step this many times the median is no step of the loop's (an evaluation, a checkpoint, an
# epoch's start): the steady statistics leave it out, and its stack samples place no steady cost.
OUTLIER_FACTOR = 10.0
WORKERS_PER_CORE = 4  # DataLoader workers beyond this many per core only compete for the cores (each is a process)


@dataclass(kw_only=True)
class ProfileConfig:
    interval_s: float = 0.1
    """How often the GPUs and the process are sampled (NVML, psutil)."""
    warmup_steps: int = 2
    """First steps left out of the statistics: lazy CUDA init, cuDNN autotuning, allocator growth."""
    kernel_window_steps: int = 3
    """On CUDA, steps captured with torch.profiler after warm-up to count kernels and measure how long
    the device was busy per step (left out of the statistics); 0: off."""
    memory_window: bool = True
    """Measure one step's memory after warm-up (and the kernel window): the peak and what it is made
    of (parameters, gradients, optimizer state, activations per module, inputs, the rest). Two steps,
    left out of the statistics (torch.profiler records their allocations)."""
    operators_window: bool = True
    """On a CPU run where no nn.Module ran, time the torch functions called outside any module over 3
    steps after warm-up (a forward written with torch functions is compute, not Python); left out
    of the statistics."""
    stack_interval_s: float = 0.02
    """How often the training thread's Python stack is sampled for each phase's hottest user line; 0: off."""
    trace_steps: int = 2000
    """Steps whose spans (forward, backward, syncs, ...) go into trace.json; later ones appear whole,
    so the trace of a long run stays small."""
    detail_steps: int = 10_000
    """Steps recorded one by one (the window the per-step findings judge); later ones in aggregate
    blocks (times per phase, a step-time histogram, the longest step): any run's recording stays small."""
    hang_after_s: float = 0.0
    """No process of the job finishing a step or a collective for this long is a hang, said at once
    with where each rank is blocked; 0: max(60 s, 100 x the slowest median step)."""
    on_hang: str = "stop"
    """Then "stop" the job (the report is written) or "wait" (for the job, or for you: py-spy dump, gdb)."""
    stop_after_steps: int = 0
    """End each process once it has run this many steps (`gpulab profile --try`); 0: run to the end."""
    dataloader_overrides: dict = field(default_factory=dict)
    """DataLoader arguments forced on every DataLoader the script builds (`--try num_workers=2`)."""
    torch_threads: int = 0
    """torch's intra-op threads forced in every process, whatever the script sets (`--try threads=1`);
    0: as the script sets them."""

    def __post_init__(self):
        # Written so that nan fails every check: a comparison with nan is always false.
        if not 0 < self.interval_s <= 60:
            raise UserError(f"--interval {self.interval_s}: use a positive number of seconds up to 60, e.g. 0.1")
        if not 0 <= self.stack_interval_s <= 10:
            raise UserError(f"stack_interval_s {self.stack_interval_s}: use 0 (off) or a few milliseconds, e.g. 0.02")
        # inf is refused too: report.json would hold it as Infinity, which strict JSON readers reject.
        if not (0 <= self.hang_after_s and math.isfinite(self.hang_after_s)):
            raise UserError(f"--hang-after {self.hang_after_s}: use seconds (e.g. 300), or 0 for max(60 s, 100 steps)")
        if self.on_hang not in ("stop", "wait"):
            raise UserError(f"--on-hang {self.on_hang}: use stop (end the job, write the report) or wait")
        check_count("warmup_steps", self.warmup_steps, 0, "use 0 or more")
        check_count("kernel_window_steps", self.kernel_window_steps, 0, "use 0 (off) or more")
        check_count("detail_steps", self.detail_steps, 1, "use 1 or more")
        check_count("torch_threads", self.torch_threads, 0, "use 0 (as the script sets them) or more")
        check_count("trace_steps", self.trace_steps, 0, "use 0 or more")
        check_count("stop_after_steps", self.stop_after_steps, 0, "use 0 (run to the end) or more")

    def to_dict(self) -> dict:
        return asdict(self)


def check_count(name: str, value, minimum: int, fix: str) -> None:
    """A count of steps or threads is a whole number: a float (nan, 2.5) given from Python would
    fail later, far from the setting that caused it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"{name} {value}: {fix}")
