"""The timing harness every benchmark shares, and the equality checks that come before timing.

How a measurement is taken (`measure`):
1. warm-up calls, untimed in the result: the first call pays for allocation, cuDNN/cuBLAS
   heuristics, lazy module loading and cold caches, none of which a training loop pays per step;
2. calibration: the call is repeated `inner` times per sample so that one sample lasts at least
   `min_sample_s`; a single 5 µs call is below what a clock (or a CUDA event pair) resolves well;
3. `repeats` samples, each bracketed by the right clock, reported as the median per call with
   the interquartile range (IQR), min and max: the median ignores the odd sample hit by another
   process, and the IQR says how much to trust it.

Clocks:
- "cpu": `time.perf_counter`; CPU work is synchronous, so the wall clock is the work.
- "cuda-events": a CUDA event pair on the device's current stream. A host timer around a CUDA
  call measures only the launch; events measure when the GPU actually got to each point, idle
  gaps included (so launch-bound small kernels are charged honestly).
- "wall+sync": synchronize every device involved, start the host clock, run, synchronize again.
  Used when work spans several GPUs or streams (events on one stream would miss the others)
  and when the host-visible time is the point (transfers, host reads).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch

from gpulab.devices import synchronize


@dataclass
class Timing:
    """Seconds per call of one measured function."""

    median_s: float
    iqr_s: float
    """Interquartile range of the per-call samples (p75 - p25): the spread."""
    min_s: float
    max_s: float
    repeats: int
    """Number of timed samples."""
    inner: int
    """Calls per sample (the per-call time is a sample's time / inner)."""
    clock: str

    def to_dict(self) -> dict:
        return asdict(self)


def pick_clock(devices: Iterable[torch.device], clock: str = "auto") -> str:
    devices = set(devices)
    cuda = {d for d in devices if d.type == "cuda"}
    if clock != "auto":
        return clock
    if not cuda:
        return "cpu"
    # One GPU and nothing else: events on its stream. Several devices: only a host clock
    # between two full synchronizations sees all of them.
    return "cuda-events" if len(devices) == 1 else "wall+sync"


def measure(
    fn: Callable[[], object],
    devices: Iterable[torch.device],
    *,
    clock: str = "auto",
    warmup: int = 2,
    repeats: int = 7,
    min_sample_s: float = 0.02,
    max_total_s: float = 10.0,
    min_repeats: int = 3,
    max_inner: int = 100_000,
) -> Timing:
    """Time `fn()` on `devices`; see the module docstring for the method.

    `max_total_s` caps the timed phase: once exceeded, sampling stops after `min_repeats`
    samples, so a size that turns out slow costs seconds, not minutes.
    """
    devices = list(devices)
    clock = pick_clock(devices, clock)
    sample = _SAMPLERS[clock]

    estimate = math.inf
    for _ in range(max(1, warmup)):
        estimate = min(estimate, sample(fn, devices, 1))
    inner = 1 if estimate >= min_sample_s else min(max_inner, math.ceil(min_sample_s / max(estimate, 1e-9)))

    per_call: list[float] = []
    started = time.perf_counter()
    while len(per_call) < repeats:
        per_call.append(sample(fn, devices, inner) / inner)
        if len(per_call) >= min_repeats and time.perf_counter() - started > max_total_s:
            break
    return summarize(per_call, inner, clock)


def summarize(per_call: list[float], inner: int, clock: str) -> Timing:
    if len(per_call) >= 2:
        q1, _, q3 = statistics.quantiles(per_call, n=4, method="inclusive")
    else:
        q1 = q3 = per_call[0]
    return Timing(
        median_s=statistics.median(per_call),
        iqr_s=q3 - q1,
        min_s=min(per_call),
        max_s=max(per_call),
        repeats=len(per_call),
        inner=inner,
        clock=clock,
    )


def _sample_cpu(fn, devices, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return time.perf_counter() - t0


def _sample_events(fn, devices, inner: int) -> float:
    (device,) = {d for d in devices}
    torch.cuda.synchronize(device)  # start from an idle GPU: earlier work must not be charged
    stream = torch.cuda.current_stream(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    for _ in range(inner):
        fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0  # ms -> s


def _sample_wall_sync(fn, devices, inner: int) -> float:
    synchronize(devices)
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    synchronize(devices)
    return time.perf_counter() - t0


_SAMPLERS = {"cpu": _sample_cpu, "cuda-events": _sample_events, "wall+sync": _sample_wall_sync}


# ----------------------------------------------------------------------------- equality checks


class ResultMismatch(AssertionError):
    """Two ways that should compute the same result did not: the timing would be meaningless."""

    def __init__(self, message: str, check: Check | None = None):
        super().__init__(message)
        self.check = check


@dataclass
class Check:
    """The record of one equality check, kept in the benchmark's JSON."""

    what: str
    max_abs_diff: float
    tolerance: str
    passed: bool

    def to_dict(self) -> dict:
        return asdict(self)


def check_close(what: str, actual, expected, *, rtol: float = 1e-5, atol: float = 1e-6) -> Check:
    """Compare two results (tensors, or lists of tensors) before timing them.

    Raises `ResultMismatch` when they differ beyond tolerance; exact equality is asked for
    with rtol=atol=0 (e.g. boolean masks, which must be identical).
    """
    pairs = list(zip(actual, expected)) if isinstance(actual, list | tuple) else [(actual, expected)]
    if isinstance(actual, list | tuple) and len(actual) != len(expected):
        raise ResultMismatch(f"{what}: {len(actual)} results vs {len(expected)}")
    worst = 0.0
    passed = True
    for a, e in pairs:
        a, e = torch.as_tensor(a), torch.as_tensor(e)
        if a.shape != e.shape:
            raise ResultMismatch(f"{what}: shapes differ, {tuple(a.shape)} vs {tuple(e.shape)}")
        a, e = a.detach().cpu(), e.detach().cpu()
        if a.dtype == torch.bool or e.dtype == torch.bool:
            diff = (a != e).float()
            passed &= not bool(diff.any())
        else:
            a, e = a.double(), e.double()
            diff = (a - e).abs()
            passed &= bool(torch.all(diff <= atol + rtol * e.abs()))
        if diff.numel():
            worst = max(worst, float(diff.max()))
    tolerance = "exact" if rtol == 0 and atol == 0 else f"rtol={rtol:g}, atol={atol:g}"
    check = Check(what=what, max_abs_diff=worst, tolerance=tolerance, passed=passed)
    if not passed:
        raise ResultMismatch(f"{what}: results differ (max |diff| {worst:.3g}, allowed {tolerance})", check)
    return check
