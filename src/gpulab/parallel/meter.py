"""Running training metrics, kept on the device so a step never waits for the host."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class Meter:
    """Running loss sum and correct count on the device; the sample count is known on the host.

    Read once per epoch (`read`), or combined over every rank first (`Strategy.reduce`); its
    loss sum doubles as the non-finite flag that `FiniteWatch` reads every so many steps."""

    def __init__(self, device: torch.device):
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        self.totals += torch.stack([loss_sum.double(), correct.double()])
        self.count += count

    def read(self) -> dict[str, float]:
        """One host read for the whole epoch."""
        loss_sum, correct = self.totals.tolist()
        return summarize(loss_sum, correct, self.count)


class FiniteWatch:
    """Whether every training step so far had a finite loss, read every so many steps without a
    per-step host sync and, on a GPU, without making the device wait at all.

    The flag is the meter's running loss sum itself, accumulated on the device with the metrics:
    NaN and +-inf stay in a sum once they are in it, so a finite sum means every step's loss was
    finite, at no extra cost per step. `poll()` starts copying the sum to the host (summed over
    every rank first by `combine`, a collective in step order, so that every rank reads the same
    value at the same step and all stop together) and returns what the previous poll copied: on a
    GPU that copy finished long ago (it only waited for the steps before it), so reading it costs
    nothing; elsewhere the value is read at once."""

    def __init__(self, meter: Meter, combine: Callable[[torch.Tensor], None] | None = None):
        self.meter = meter
        self.combine = combine
        self.device = meter.totals.device
        self.pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    def poll(self, step: int) -> tuple[float, int] | None:
        """(the loss sum, the step it was taken after) once it is not finite, else None."""
        snapshot = self.meter.totals[:1].clone()
        if self.combine is not None:
            self.combine(snapshot)
        if self.device.type != "cuda":
            return _non_finite(snapshot.item(), step)
        host = torch.empty(1, dtype=snapshot.dtype, pin_memory=True)
        host.copy_(snapshot, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        previous, self.pending = self.pending, (host, event, step)
        if previous is None:
            return None
        host, event, step = previous
        event.synchronize()  # long done: it followed the steps before the previous poll
        return _non_finite(host.item(), step)  # host memory: no device sync


def _non_finite(value: float, step: int) -> tuple[float, int] | None:
    return None if math.isfinite(value) else (value, step)


def summarize(loss_sum: float, correct: float, count: float) -> dict[str, float]:
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "count": int(count)}


def classifies(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Class scores (N, C) for integer labels (N,): top-1 accuracy means something. Read from
    shapes and dtypes only, never from values (no host sync)."""
    return outputs.dim() == 2 and targets.dim() == 1 and not (targets.is_floating_point() or targets.is_complex())


def correct_count(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Top-1 hits on the device; zero where accuracy does not apply (regression, sequences, ...)."""
    if classifies(outputs, targets):
        return (outputs.argmax(1) == targets).sum()
    return torch.zeros((), dtype=torch.long, device=outputs.device)
