"""What an epoch's checkpoint costs the training thread: written in the epoch's end (torch.save,
then the atomic write with its fsyncs, as gpulab did) against what it costs now (the state copied;
the writing on a thread of its own while the next epoch trains: train/loop.py's write_epoch), for
LeNet and ResNet-18 with SGD's momentum, side by side in alternating rounds.

    PYTHONPATH=src python benchmarks/checkpoint_write.py [--rounds 5] [--out benchmarks/results/<machine>]
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from gpulab import models
from gpulab.io import atomic_write_bytes, git_commit
from gpulab.train.loop import detached


def trained_state(name: str) -> dict:
    model = models.build(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 1, 28, 28)).sum().backward()
    optimizer.step()  # momentum buffers: a checkpoint's optimizer state
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def written_in_the_epoch(state: dict, path: Path) -> float:
    start = time.perf_counter()
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())
    return time.perf_counter() - start


def copied_for_the_thread(state: dict) -> float:
    start = time.perf_counter()
    detached(state)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="folder for checkpoint_write.json")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("lenet", "resnet18"):
            state = trained_state(name)
            rows[name] = {"written": [], "copied": []}
            for _ in range(args.rounds):
                rows[name]["written"].append(written_in_the_epoch(state, Path(tmp) / "checkpoint.pt"))
                rows[name]["copied"].append(copied_for_the_thread(state))
    print(f"the training thread's cost of an epoch's checkpoint, ms, median [min .. max] over {args.rounds} rounds")
    for name, times in rows.items():
        line = "  ".join(f"{kind} {statistics.median(v) * 1e3:7.1f} [{min(v) * 1e3:.1f} .. {max(v) * 1e3:.1f}]"
                         for kind, v in times.items())
        print(f"  {name:9s} {line}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "checkpoint_write.json").write_text(json.dumps({"git_commit": git_commit(), "seconds": rows},
                                                                  indent=2))


if __name__ == "__main__":
    main()
