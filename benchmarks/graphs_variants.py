"""Which settings make the recorded whole step (`gpulab train --compile graphs`) fastest on one GPU,
beside the textbook on the same card.

On an H200 the replayed LeNet step keeps the card busy back to back (gpulab profile: device busy
100% in the kernel window) while using ~16% of its SMs: the step is the latency of its own small
kernels now, not Python's. What is left to try is the math and its shape: bf16 autocast,
channels_last (cuDNN's NHWC kernels), a larger batch (fewer, fuller steps; a recipe change, so its
accuracy is printed beside it). This runs each as a whole `gpulab train` process, the textbook's
port first in every round and the variants after it in turn (interleaved: the machine's drift hits
all alike), and prints per variant the median training seconds per epoch (gpulab's metrics.json:
compile and evaluation apart; the textbook's own epoch clock), its ratio to the textbook round by
round, [min .. max], and the test accuracy. `--budget-s` stops starting rounds when spent; the
JSON is rewritten after every round.

    PYTHONPATH=src python benchmarks/graphs_variants.py [--devices cuda] [--epochs 3] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gpulab.bench.environment import environment
from gpulab.bench.training import GPULAB_TRAIN, TEXTBOOK, TEXTBOOK_SCRIPT, compare, data_folder, run_once
from gpulab.io import atomic_write_json

VARIANTS = {
    "graphs (fp32, NCHW, batch 256)": ["--precision", "fp32", "--channels-last", "off"],
    "graphs + bf16": ["--precision", "bf16", "--channels-last", "off"],
    "graphs + channels_last": ["--precision", "fp32", "--channels-last", "on"],
    "graphs + bf16 + channels_last": ["--precision", "bf16", "--channels-last", "on"],
    "graphs, batch 512, lr 0.2": ["--precision", "fp32", "--channels-last", "off", "--batch-size", "512", "--lr", "0.2"],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="cuda")
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (default 3: the first records the step)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=None, help="training samples (default: all; fewer to smoke-test)")
    parser.add_argument("--budget-s", type=float, default=float("inf"), help="start no round after this many seconds")
    parser.add_argument("--out", default=None, help="JSON file for every run and the summary")
    args = parser.parse_args()

    compile_flag = ["--compile", "graphs" if args.devices.startswith("cuda") else "on"]
    commands = {TEXTBOOK: TEXTBOOK_SCRIPT}
    commands |= {name: [*GPULAB_TRAIN, "--devices", args.devices, *compile_flag, *flags] for name, flags in VARIANTS.items()}
    t0, rounds, failed = time.perf_counter(), [], {}
    with tempfile.TemporaryDirectory(prefix="gpulab-graphs-variants-") as tmp:
        data_dir = data_folder(Path(tmp) / "data", args.samples)
        for r in range(args.rounds):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: {r} round(s) run")
                break
            row = {}
            for i, (name, cmd) in enumerate(list(commands.items())):
                try:
                    row[name] = run_once(cmd, args.epochs, args.devices, data_dir, Path(tmp) / f"{r}-{i}", 3600.0)
                except RuntimeError as e:  # a variant that fails is a result too; the others still run
                    print(f"{name}: {e}", flush=True)
                    commands.pop(name)
                    failed[name] = str(e)
            if TEXTBOOK not in row:  # nothing to compare with
                raise SystemExit(f"graphs_variants: the textbook's run failed ({failed[TEXTBOOK]}); no ratios")
            rounds.append(row)
            print(f"round {r + 1}: " + ", ".join(f"{name} {v['train_s']:.3f} s" for name, v in row.items()), flush=True)
            summary = compare(by_variant(rounds), args.epochs)
            if args.out:
                atomic_write_json(Path(args.out), {"benchmark": "graphs_variants", "devices": args.devices,
                                                   "epochs": args.epochs, "env": environment(),
                                                   "summary": summary, "failed": failed, "rounds": rounds})
    print(f"{'variant':34} {'s/epoch, training':>18} {'vs textbook [min .. max]':>26} {'test acc':>9}")
    for name, s in summary.items():
        print(f"{name:34} {s['train_s']:>18.3f} {s['train_ratio']:>8.2f}x [{s['train_ratio_min']:.2f} .. "
              f"{s['train_ratio_max']:.2f}] {s['test_acc']:>9.3f}")


def by_variant(rounds: list[dict]) -> dict[str, list[dict]]:
    """{variant: its runs, round by round}. A variant that failed runs in no later round, so its
    runs are the first rounds' and pair with the textbook's first runs."""
    names = dict.fromkeys(name for row in rounds for name in row)
    return {name: [row[name] for row in rounds if name in row] for name in names}


if __name__ == "__main__":
    main()
