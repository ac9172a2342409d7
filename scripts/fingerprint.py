"""Fingerprint what a fixed-seed training computes, to show a refactor changed nothing.

Trains a few configurations that cover gpulab's paths (one device; k devices in one process with
the textbook recipe; a user's own data; 2 torchrun ranks with gpulab's sync and accumulation,
with DDP, with FSDP2 and accumulation) and prints,
for each, the sha256 of every tensor the final checkpoint holds (weights and optimizer state) and
each epoch's losses written exactly (float.hex). Two checkouts that print the same lines trained
bit for bit the same.

    .venv/bin/python scripts/fingerprint.py > after.txt                    # this checkout
    PYTHONPATH=/path/to/old/src .venv/bin/python scripts/fingerprint.py > before.txt
    diff before.txt after.txt && echo bit-identical

Only the public interface is used (`gpulab train`, `gpulab launch`, gpulab.train.train), so the
script runs against older checkouts too. About a minute on 2 cores; needs Fashion-MNIST.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from rich.console import Console

# Real data, 1 epoch of 60,000 images, fixed seeds, one thread each: deterministic on one machine.
CLI_RUNS = {
    "1 device, modern recipe": ["train", "--devices", "cpu", "--epochs", "1", "--seed", "3"],
    "cpu*2 in one process, textbook recipe": ["train", "--devices", "cpu*2", "--epochs", "1", "--recipe", "textbook"],
    "2 torchrun ranks (gloo), accumulate 2": ["launch", "-n", "2", "--", "--devices", "cpu", "--epochs", "1",
                                               "--accumulate", "2"],
    "2 torchrun ranks (gloo), --sync ddp": ["launch", "-n", "2", "--", "--devices", "cpu", "--epochs", "1",
                                            "--sync", "ddp"],
    "2 torchrun ranks (gloo), --shard fsdp, accumulate 2": ["launch", "-n", "2", "--", "--devices", "cpu",
                                                            "--epochs", "1", "--shard", "fsdp", "--accumulate", "2"],
}


def tensor_digest(state) -> str:
    """sha256 over every tensor in a nested state (dicts in key order), with its dtype and shape."""
    h = hashlib.sha256()

    def visit(x, path: str) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{path}:{t.dtype}:{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                visit(x[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, f"{path}[{i}]")

    visit(state, "")
    return h.hexdigest()[:16]


def strategy_state(run_dir: Path, checkpoint: dict) -> dict:
    """The checkpoint's model and optimizer state; a sharded run's read back whole from its shards."""
    state = checkpoint["strategy"]
    if "shards" not in state:
        return state
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = run_dir / "whole.pt"
    dcp_to_torch_save(run_dir / state["shards"], whole)
    return torch.load(whole, map_location="cpu", weights_only=False)


def describe(run_dir: Path) -> str:
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    rows = json.loads((run_dir / "metrics.json").read_text())  # one row per epoch
    losses = " ".join(f"{r['train_loss'].hex()}/{r['test_loss'].hex()}" for r in rows)
    return f"weights+optimizer {tensor_digest(strategy_state(run_dir, checkpoint))}  losses {losses}"


def cli_run(args: list[str], out: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "gpulab", *args, "--out", str(out)]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    return describe(out)


def own_data_run(out: Path) -> str:
    """A user's Dataset (the path through gpulab's host loader), on cpu*2."""
    from gpulab.train import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    images, labels = torch.rand(600, 1, 28, 28, generator=g), torch.randint(0, 10, (600,), generator=g)
    data = torch.utils.data.TensorDataset(images, labels)
    torch.set_num_threads(1)
    train(TrainConfig(devices="cpu*2", epochs=2, batch_size=64, out=str(out)), train_data=data, test_data=data,
          console=Console(quiet=True))
    return describe(out)


def main() -> None:
    import gpulab

    print(f"(gpulab from {Path(gpulab.__file__).parent})", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="gpulab-fingerprint-") as tmp:
        for i, (name, args) in enumerate(CLI_RUNS.items()):
            print(f"{name}: {cli_run(args, Path(tmp) / str(i))}", flush=True)
        print(f"own Dataset, cpu*2, 2 epochs: {own_data_run(Path(tmp) / 'own')}", flush=True)


if __name__ == "__main__":
    main()
