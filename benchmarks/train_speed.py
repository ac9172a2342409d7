"""gpulab's trainer vs a faithful port of the textbook's multi-GPU chapter, same data, same steps.

The textbook implementation (ported to PyTorch as the chapter writes it):
  - per-sample Dataset (uint8 -> float/255, like ToTensor) + DataLoader(shuffle, 4 workers);
  - functional LeNet over a list of parameter tensors, N(0, 0.01^2) init;
  - `split_batch` + per-device loss.sum().backward() + allreduce + manual `sgd` (lr 0.2);
gpulab: DeviceLoader (dataset resident on the device), nn.Module LeNet, DataParallel step,
metrics on the device, default (modern) recipe; on CPU by default channels_last and bf16
autocast (where the CPU has native bf16). The two fp32 rows show what each setting adds.

Each contender trains one epoch (234 minibatches of 256) and is then evaluated on the test set;
`--rounds` times, the contenders in turn each round, so that the machine's drift hits all alike.
Prints each contender's samples/s, test accuracy and ratio to the textbook port (median over the
rounds, [min .. max] of the per-round ratios); with `--out FILE` also writes every round as JSON
(with the git commit it ran on).

    PYTHONPATH=src python benchmarks/train_speed.py [--devices cpu] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from gpulab import data
from gpulab.bench import textbook
from gpulab.bench.environment import environment
from gpulab.devices import resolve, synchronize
from gpulab.io import atomic_write_json
from gpulab.train import TrainConfig, build
from gpulab.train.loop import evaluate, run_epoch

BATCH = textbook.BATCH

# ----------------------------------------------------------------------------- the textbook's way


def run_textbook(train_split, test_split, device, steps: int) -> dict:
    torch.manual_seed(0)
    params = textbook.params(device)
    train_iter = DataLoader(data.ImageDataset(train_split), BATCH, shuffle=True, num_workers=4)
    test_iter = DataLoader(data.ImageDataset(test_split), BATCH, num_workers=4)
    done, t0 = 0, time.perf_counter()
    while done < steps:
        for X, y in train_iter:
            textbook.train_batch(X.to(device), y.to(device), [params], [device], lr=textbook.LR)
            synchronize([device])  # the chapter waits for every batch
            done += 1
            if done == steps:
                break
    seconds = time.perf_counter() - t0
    correct = total = 0
    with torch.no_grad():
        for X, y in test_iter:  # the chapter evaluates on one device, one batch at a time
            correct += (textbook.lenet(X.to(device), params).argmax(1) == y.to(device)).sum().item()
            total += len(y)
    return {"samples_per_s": steps * BATCH / seconds, "seconds": seconds, "test_acc": correct / total}


# ----------------------------------------------------------------------------- gpulab's way


def run_gpulab(devices: str, channels_last: str = "auto", precision: str = "auto") -> dict:
    """One epoch of gpulab's own trainer loop (run_epoch), then its evaluation."""
    run = build(TrainConfig(devices=devices, epochs=1, channels_last=channels_last, precision=precision))
    epoch = run_epoch(run, 0)
    return {"samples_per_s": epoch["samples_per_s"], "seconds": epoch["train_seconds"], "test_acc": evaluate(run)["test_acc"]}


CONTENDERS = {
    "textbook (DataLoader x4 workers, functional LeNet, manual SGD)": None,
    "gpulab, fp32, channels_last off": ("off", "fp32"),
    "gpulab, fp32, channels_last auto": ("auto", "fp32"),
    "gpulab (default: channels_last auto, precision auto)": ("auto", "auto"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cpu")
    parser.add_argument("--rounds", type=int, default=3, help="every contender once per round (default 3)")
    parser.add_argument("--out", default=None, help="JSON file for the results (default: print only)")
    args = parser.parse_args()

    device = resolve(args.devices)[0]
    train_split, test_split = data.load()
    steps = len(train_split) // BATCH  # one epoch, as gpulab's trainer runs it (the short last batch left out)
    rounds = []
    for r in range(args.rounds):
        row = {}
        for name, settings in CONTENDERS.items():
            row[name] = (run_textbook(train_split, test_split, device, steps) if settings is None
                         else run_gpulab(args.devices, *settings))
        base = row[next(iter(CONTENDERS))]["samples_per_s"]
        for result in row.values():
            result["ratio_vs_textbook"] = result["samples_per_s"] / base
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{v['ratio_vs_textbook']:.2f}x" for v in row.values()))
        rounds.append(row)

    median = statistics.median
    summary = {}
    print(f"{steps} steps of batch {BATCH} on {args.devices}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds")
    print(f"{'contender':66} {'samples/s':>10} {'test acc':>9} {'vs textbook [min .. max]':>26}")
    for name in CONTENDERS:
        ratios = [row[name]["ratio_vs_textbook"] for row in rounds]
        summary[name] = {"samples_per_s": median(row[name]["samples_per_s"] for row in rounds),
                         "test_acc": median(row[name]["test_acc"] for row in rounds),
                         "ratio_vs_textbook": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}
        s = summary[name]
        print(f"{name:66} {s['samples_per_s']:>10,.0f} {s['test_acc']:>9.3f} "
              f"{s['ratio_vs_textbook']:>8.2f}x [{s['ratio_min']:.2f} .. {s['ratio_max']:.2f}]")
    if args.out:
        env = environment()  # the same record every benchmark JSON carries
        result = {
            "benchmark": "train_speed",
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "git_commit": env["git_commit"],
            "devices": args.devices,
            "steps": steps,
            "batch_size": BATCH,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu": env["cpu"]["model"],
            "gpus": [g["name"] for g in env["gpus"]],
            "machine": platform.machine(),
            "rows": summary,
            "rounds": rounds,
        }
        atomic_write_json(Path(args.out), result)


if __name__ == "__main__":
    main()
