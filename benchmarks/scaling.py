"""The data-parallel scaling benchmark: samples/s of LeNet and ResNet-18 for k = 1..n devices,
with scaling efficiency, per-device and global batch fixed.

A thin wrapper: the benchmark lives in `gpulab.bench.scaling`; this is `gpulab bench scaling`
with the same options, for readers who look for it next to the other benchmarks.

    PYTHONPATH=src python benchmarks/scaling.py [--devices cpu*4 | cuda:0,cuda:1] [--quick] [--out DIR]
"""

import sys
from pathlib import Path

# Run from a checkout without installing: the package is in ../src.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gpulab.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["bench", "scaling", *sys.argv[1:]]))
