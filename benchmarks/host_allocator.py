"""glibc malloc's thresholds fixed (gpulab's default, gpulab/host.py) vs left to glibc, side by
side: LeNet's training step (gpulab train's own, via `gpulab.plan.step`; two copies in step, as
two ranks of one machine, one thread each) on a small copy of Fashion-MNIST and on the whole
set, in alternating rounds.

    PYTHONPATH=src python benchmarks/host_allocator.py [--rounds 3] [--out benchmarks/results/<machine>]

With glibc's own thresholds a step's activations are mmapped and unmapped every step (page
faults, zeroed pages) until some earlier large block was freed; loading the whole dataset happens
to free one, a small copy does not. Fixed thresholds give both the fast case.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from gpulab.io import git_commit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path, default=None, help="folder for host_allocator.json")
    args = parser.parse_args()

    from gpulab.data.fashion_mnist import write_subset
    from gpulab.plan import step

    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        small = write_subset(Path(tmp) / "small", 256 * 40)
        for r in range(args.rounds):
            for data_name, data_dir in (("small copy", str(small)), ("whole set", None)):
                for malloc in ("fixed", "default"):
                    os.environ["GPULAB_MALLOC"] = malloc  # read by the child process that profiles
                    cfg = {"model": "lenet", "batch_size": 128, "devices": "cpu", "data_dir": data_dir}
                    p = step.measure(cfg, 128, 1, seconds=args.seconds, copies=2)
                    name = f"{data_name}, malloc {malloc}"
                    rows.setdefault(name, []).append(p.step_s)
                    print(f"round {r + 1}: {name}: {p.step_s * 1e3:.1f} ms/step", flush=True)
    print("\nLeNet, batch 128, 2 copies x 1 thread: ms per step (median [min .. max] over rounds)")
    for name, values in rows.items():
        print(f"  {name:28s} {statistics.median(values) * 1e3:6.1f}  [{min(values) * 1e3:.1f} .. {max(values) * 1e3:.1f}]")
    ratios = {}
    for data_name in ("small copy", "whole set"):
        pairs = zip(rows[f"{data_name}, malloc default"], rows[f"{data_name}, malloc fixed"])
        ratios[data_name] = [d / f for d, f in pairs]
        print(f"  {data_name}: default / fixed step time {statistics.median(ratios[data_name]):.2f}x "
              f"[{min(ratios[data_name]):.2f} .. {max(ratios[data_name]):.2f}]")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_allocator.json").write_text(json.dumps({"git_commit": git_commit(), "step_s": rows, "default_over_fixed": ratios}, indent=2))


if __name__ == "__main__":
    main()
