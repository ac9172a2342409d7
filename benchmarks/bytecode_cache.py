"""What a read-only install costs each `gpulab train` process, and what gpulab's own bytecode
cache (gpulab/bytecode.py) gives back from its second run on.

Three ways a process finds its modules' bytecode, each a whole `gpulab train` process, the three
interleaved round by round (the machine's drift hits all alike):

- "installed bytecode": the install as pip leaves it, `__pycache__/` beside every source.
- "read-only, no bytecode": what a read-only install without bytecode costs every process:
  Python compiles every module it imports from source and can keep nothing
  (PYTHONDONTWRITEBYTECODE=1, and an empty prefix, so the installed bytecode is not read).
- "gpulab's cache, warm": the prefix gpulab sets on such an install (PYTHONPYCACHEPREFIX, here
  set by hand: this install is writable), after one run has filled it - every later run.

Prints each one's median wall seconds [min .. max], and the cost of compiling from source as the
median of the per-round differences.

    PYTHONPATH=src python benchmarks/bytecode_cache.py [--rounds 3] [--epochs 1] [--devices cpu]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--devices", default="cpu")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="gpulab-bytecode-") as tmp:
        tmp = Path(tmp)
        warm, empty = tmp / "warm", tmp / "empty"
        base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE")}
        ways = {
            "installed bytecode": base,
            "read-only, no bytecode": {**base, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPYCACHEPREFIX": str(empty)},
            "gpulab's cache, warm": {**base, "PYTHONPYCACHEPREFIX": str(warm)},
        }

        def train(out: Path) -> list[str]:
            return [sys.executable, "-m", "gpulab", "train", "--devices", args.devices, "--epochs", str(args.epochs),
                    "--out", str(out)]

        run(train(tmp / "fill"), ways["gpulab's cache, warm"])  # the first run, which fills the cache
        seconds: dict[str, list[float]] = {name: [] for name in ways}
        for r in range(args.rounds):
            for name, env in ways.items():
                seconds[name].append(run(train(tmp / f"{r}-{len(seconds[name])}-{name[:4]}"), env))
            print(f"round {r + 1}: " + ", ".join(f"{n} {s[-1]:.1f} s" for n, s in seconds.items()), flush=True)
        print(f"\ngpulab train --devices {args.devices} --epochs {args.epochs}, whole process, {args.rounds} rounds "
              "interleaved: median [min .. max]")
        for name, s in seconds.items():
            print(f"  {name:24s} {statistics.median(s):6.1f} s [{min(s):.1f} .. {max(s):.1f}]")
        compiling = [c - w for c, w in zip(seconds["read-only, no bytecode"], seconds["gpulab's cache, warm"])]
        print(f"  compiling from source costs {statistics.median(compiling):.1f} s a process "
              f"[{min(compiling):.1f} .. {max(compiling):.1f}]; gpulab's cache gives it back from the second run")


if __name__ == "__main__":
    main()
