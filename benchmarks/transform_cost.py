"""What does `gpulab profile` add to a per-sample transform? (issue 28, item 8)

A DataLoader (batch 64, num_workers=0) whose Dataset runs K trivial nn.Module transforms per
sample; the script times each fetch itself and prints the median fetch over the steps after
STEADY_FROM (past warm-up and gpulab's measurement windows). Run plain and profiled in turn, for
K = 0 and K = TRANSFORMS; the cost per transform call is the profiled-minus-plain fetch time that
the K transforms add, divided by the K x 64 calls:

    ((prof_K - plain_K) - (prof_0 - plain_0)) / (K * 64)

`--before OLD_SRC` adds the same runs profiled by another checkout of gpulab (its src/ folder).

    flock /tmp/gpulab-cpu.lock env PYTHONPATH=src .venv/bin/python benchmarks/transform_cost.py --before OLD/src
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BATCH = 64
TRANSFORMS = 8
STEADY_FROM = 20

SCRIPT = '''
import statistics, time, torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
torch.manual_seed(0); torch.set_num_threads(1)
class Shift(nn.Module):
    def forward(self, x): return x
class Images(Dataset):
    def __init__(self): self.x, self.t = torch.randn(STEPS * BATCH, 28, 28), [Shift() for _ in range(NTRANSFORMS)]
    def __len__(self): return len(self.x)
    def __getitem__(self, i):
        x = self.x[i]
        for t in self.t: x = t(x)
        return x, i % 10
model = nn.Sequential(nn.Flatten(), nn.Linear(784, 64), nn.ReLU(), nn.Linear(64, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches, fetches = iter(DataLoader(Images(), batch_size=BATCH)), []
while True:
    t0 = time.perf_counter()
    try:
        X, y = next(batches)
    except StopIteration:
        break
    fetches.append(time.perf_counter() - t0)
    loss = nn.functional.cross_entropy(model(X), y)
    opt.zero_grad(); loss.backward(); opt.step()
print(f"fetch_s={statistics.median(fetches[STEADY_FROM:]):.7f}")
'''


def fetch_seconds(argv: list[str], cwd: Path, src: Path | None = None) -> float:
    env = {**os.environ, "PYTHONPATH": str(src)} if src is not None else None
    result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{result.stderr[-2000:]}")
    return float(re.search(r"fetch_s=(\S+)", result.stdout).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=120, help="batches per run")
    parser.add_argument("--before", type=Path, help="also profile with this checkout's src/ (side by side)")
    args = parser.parse_args()
    variants = {"this": Path(__file__).resolve().parent.parent / "src"}
    if args.before:
        variants["before"] = args.before.resolve()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        scripts = {}
        for k in (0, TRANSFORMS):
            scripts[k] = out / f"k{k}.py"
            scripts[k].write_text(SCRIPT.replace("STEPS", str(args.steps)).replace("BATCH", str(BATCH))
                                  .replace("STEADY_FROM", str(STEADY_FROM)).replace("NTRANSFORMS", str(k)))
        # per round, per K: the plain fetch, then each variant's profiled fetch
        added = {name: {k: [] for k in scripts} for name in variants}
        plain = {k: [] for k in scripts}
        for _ in range(args.rounds):
            for k, script in scripts.items():
                base = fetch_seconds([sys.executable, str(script)], out)
                plain[k].append(base)
                for name, src in variants.items():
                    argv = [sys.executable, "-m", "gpulab", "profile", "--out", str(out / "prof"), "--",
                            sys.executable, str(script)]
                    added[name][k].append(fetch_seconds(argv, out, src) - base)
        print(f"fetch of {BATCH} samples, median over batches {STEADY_FROM}..{args.steps}, {args.rounds} rounds: "
              f"plain {statistics.median(plain[0]) * 1e3:.3f} ms with no transform, "
              f"{statistics.median(plain[TRANSFORMS]) * 1e3:.3f} ms with {TRANSFORMS} per sample")
        for name, by_k in added.items():
            per_call = [(with_k - without) / (TRANSFORMS * BATCH) for with_k, without in zip(by_k[TRANSFORMS], by_k[0])]
            print(f"{name:<7} ({variants[name]}): +{statistics.median(per_call) * 1e6:.2f} us per transform call "
                  f"[{min(per_call) * 1e6:.2f} .. {max(per_call) * 1e6:.2f}]; the fetch without transforms "
                  f"+{statistics.median(by_k[0]) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
