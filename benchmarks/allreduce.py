"""The data-parallel allreduce benchmark: algorithm (naive, ring, bucketed, NCCL, gloo) x message
size (1 KiB ... 256 MiB) x number of devices k, reporting time, algbw and busbw.

A thin wrapper: the benchmark lives in `gpulab.bench.allreduce`; this is `gpulab bench allreduce`
with the same options, for readers who look for it next to the other benchmarks.

    PYTHONPATH=src python benchmarks/allreduce.py [--devices cpu*4 | cuda:0,cuda:1] [--quick] [--out DIR]
"""

import sys
from pathlib import Path

# Run from a checkout without installing: the package is in ../src.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpulab.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", "allreduce", *sys.argv[1:]]))
