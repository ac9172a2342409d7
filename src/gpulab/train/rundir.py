"""The run directory: config.json, metrics.json/csv, curves.png, checkpoint.pt.

Every file is written to a temporary name in the same folder and renamed into place, so a
crash or Ctrl-C never leaves a half-written file: a reader sees the old version or the new.
"""

from __future__ import annotations

import csv
import io
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from gpulab.errors import UserError

CHECKPOINT = "checkpoint.pt"


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 minus umask).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: Path, obj) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2) + "\n").encode())


def default_run_dir(model: str) -> Path:
    return Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{model}"


def check_writable(run_dir: Path) -> None:
    """Fail before training if the run directory cannot be created, without creating anything."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--out {run_dir} is a file: choose a directory path")
    if (run_dir / "config.json").exists():
        raise UserError(f"--out {run_dir} already holds a gpulab run: continue it with --resume {run_dir} or choose another --out")
    parent = run_dir
    while not parent.exists():
        parent = parent.parent
    # A file part-way up (--out some.file/run): os.access alone would pass it for root when the
    # file has an x bit, and mkdir would then fail with a traceback.
    if not parent.is_dir():
        raise UserError(f"--out {run_dir}: {parent} is a file, not a folder; choose another directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--out {run_dir}: {parent} is not writable; choose another directory")


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
