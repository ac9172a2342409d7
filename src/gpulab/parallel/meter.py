"""Running training metrics, kept on the device so a step never waits for the host."""

from __future__ import annotations

import torch


class Meter:
    """Running loss sum and correct count on the device; the sample count is known on the host.

    Read once per epoch (`read`), or combined over every rank first (`Strategy.reduce`)."""

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


def summarize(loss_sum: float, correct: float, count: float) -> dict[str, float]:
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "count": int(count)}
