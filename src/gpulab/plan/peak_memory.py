"""What fits: each configuration's peak memory per device, predicted from the measured step's
memory (gpulab.memory.step, in the profile's child process), and the largest per-device batch
that fits a budget.

    replicated (gpulab's sync)  one device's measured peak at the per-device batch: every rank
                                holds the whole model, its gradients (views into the buckets it
                                sends: no copy) and its optimizer state
    replicated (--sync ddp)     the same plus one copy of the gradients: DDP's buckets hold their
                                own copy unless gradient_as_bucket_view=True
    sharded over k (FSDP/ZeRO-3)  parameters, gradients and optimizer state divided by k, plus
                                the largest unit gathered whole while it runs (its parameters, and
                                its gradients before they are reduce-scattered)

Peak memory grows with the batch (activations, the batch itself, most temporaries): a line
through the profiles measured at different per-device batches gives bytes per sample, and the
largest batch under a budget. One batch only: everything but parameters, gradients, optimizer
state and memory kept across steps is taken to grow with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpulab.errors import UserError
from gpulab.plan.profile import StepProfile

# a number, then K/M/G/T with B, iB, i or nothing after it, or a bare B, or nothing (bytes)
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(?:([KMGT])(iB|i|B)?|B?)\s*$", re.IGNORECASE)
_LARGEST = 1024**5  # a PiB per device: beyond it a size is a typo
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_memory(text: str) -> int:
    """'80GiB', '80G', '16GB', '512MiB', '2.5G' -> bytes (K, M, G, T are binary, 1024^n; with a
    B and no i - GB - decimal, 1000^n, as disk makers count)."""
    m = _SIZE.match(text or "")
    size = 0
    if m:
        number, prefix, suffix = float(m.group(1)), (m.group(2) or "").upper(), (m.group(3) or "").lower()
        base = 1000 if suffix == "b" and prefix else 1024
        size = int(number * base ** _POWERS[prefix])
    if not m or size < 1 or size > _LARGEST:
        raise UserError(f"--memory {text}: give a size such as 80GiB, 16GB, 512MiB or 2.5G (per device)")
    return size


def state_bytes(memory: dict) -> int:
    """Parameters, gradients and optimizer state: what sharding divides."""
    sizes = memory["sizes"]
    return sizes["parameters"] + sizes["gradients"] + sizes["optimizer_state"]


def sync_of(train: dict) -> str:
    """The gradient sync a plan's training config uses (gpulab train's default: gpulab)."""
    return train.get("sync") or "gpulab"


def replicated_peak(memory: dict, sync: str) -> int:
    """The measured step's peak, plus DDP's copy of the gradients (its buckets) under --sync ddp."""
    return memory["peak"] + (memory["sizes"]["gradients"] if sync == "ddp" else 0)


def sharded_peak(memory: dict, k: int, measured: tuple[int, int] | None = None) -> int:
    """The replicated peak less (k-1)/k of the state, plus the largest unit gathered twice; with
    `measured` = (copies, their sharded step's peak), plus what FSDP's own buffers added there
    (the same at every k: on those copies the prediction is their measured peak)."""
    modelled = memory["peak"] - state_bytes(memory) * (k - 1) // k + 2 * memory["largest_unit"]
    if measured is None:
        return modelled
    copies, peak = measured
    return modelled + peak - sharded_peak(memory, copies)


@dataclass
class MemoryLine:
    """peak(b) = fixed + per_sample * b, per device, replicated."""
    fixed: float
    per_sample: float
    points: int
    """How many per-device batches it was fitted through (1: the single-batch rule above)."""

    def at(self, batch: int) -> float:
        return self.fixed + self.per_sample * batch

    def largest_batch(self, budget: float, extra: float = 0.0) -> int:
        """The largest per-device batch whose peak (plus `extra`) stays within `budget` (0: none)."""
        if self.per_sample <= 0:
            return 0
        return max(0, int((budget - extra - self.fixed) // self.per_sample))


def fit_line(profiles: list[StepProfile]) -> MemoryLine | None:
    """Least squares through (per-device batch, measured peak); None without any measurement."""
    points = {}
    for p in profiles:
        if p.memory:
            points.setdefault(p.batch, p.memory["peak"])
    if not points:
        return None
    if len(points) == 1:
        batch, _ = next(iter(points.items()))
        memory = next(p.memory for p in profiles if p.memory and p.batch == batch)
        fixed = state_bytes(memory) + memory["at_peak"]["other_kept"]
        return MemoryLine(fixed=fixed, per_sample=max(0.0, (memory["peak"] - fixed) / batch), points=1)
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return MemoryLine(fixed=my - slope * mx, per_sample=max(0.0, slope), points=len(points))
