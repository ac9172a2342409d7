"""The run directory: config.json, metrics.json/csv, curves.png, checkpoint.pt.

Every file is written atomically (gpulab.io), so a crash or Ctrl-C never leaves a half-written
file. Under torchrun only rank 0 writes here.
"""

from __future__ import annotations

import csv
import io
import json
import time
from pathlib import Path

import torch

from gpulab.errors import UserError
from gpulab.io import atomic_write_bytes, atomic_write_json, check_writable as check_folder_writable

CHECKPOINT = "checkpoint.pt"


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model}"


def check_writable(run_dir: Path) -> None:
    """Fail before training if the run directory cannot be created or already holds a run."""
    check_folder_writable(run_dir)
    if (Path(run_dir) / "config.json").exists():
        raise UserError(f"--out {run_dir} already holds a gpulab run: continue it with --resume {run_dir} or choose another --out")


class RunDir:
    def __init__(self, path: Path):
        self.path = Path(path)

    def create(self) -> None:
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict) -> None:
        atomic_write_json(self.path / "config.json", config)

    def read_config(self) -> dict:
        try:
            config = json.loads((self.path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"--resume {self.path}: no readable config.json ({e}); is this a gpulab run directory?") from None
        if not isinstance(config, dict):
            raise UserError(f"--resume {self.path}: config.json is not a gpulab run config")
        return config

    def write_metrics(self, history: list[dict]) -> None:
        atomic_write_json(self.path / "metrics.json", history)
        flat = [{k: v for k, v in row.items() if not isinstance(v, dict)} for row in history]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(flat[0]))
        writer.writeheader()
        writer.writerows(flat)
        atomic_write_bytes(self.path / "metrics.csv", buf.getvalue().encode())
        self._plot_curves(history)

    def _plot_curves(self, history: list[dict]) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        epochs = [r["epoch"] for r in history]
        fig, ax = plt.subplots(figsize=(5.5, 3.5), dpi=120)
        ax.plot(epochs, [r["train_loss"] for r in history], label="train loss")
        ax.plot(epochs, [r["train_acc"] for r in history], "--", label="train acc")
        ax.plot(epochs, [r["test_acc"] for r in history], "-.", label="test acc")
        ax.set_xlabel("epoch")
        ax.set_xlim(1, max(epochs[-1], 2))
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        plt.close(fig)
        atomic_write_bytes(self.path / "curves.png", buf.getvalue())

    def save_checkpoint(self, state: dict) -> None:
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(self.path / CHECKPOINT, buf.getvalue())

    def load_checkpoint(self) -> dict:
        path = self.path / CHECKPOINT
        if not path.is_file():
            raise UserError(f"--resume {self.path}: no {CHECKPOINT} there; the run stopped before its first epoch ended")
        try:
            checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:  # truncated or foreign file: torch raises several types
            raise UserError(f"--resume {self.path}: {CHECKPOINT} is unreadable ({type(e).__name__}); it is damaged") from None
        if not isinstance(checkpoint, dict) or not {"strategy", "history", "epoch"} <= checkpoint.keys():
            raise UserError(f"--resume {self.path}: {CHECKPOINT} is not a gpulab checkpoint")
        return checkpoint
