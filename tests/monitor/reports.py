"""A profile's report.json as the tests read it, with the rule every report must keep: each line it
names (a finding's `where`, a recompile's, graph break's or skipped CUDA graph's) is the script's
or its framework's - never the profiler's own code, torch's, the standard library's, or code
torch.compile generated (inductor's cache, Triton's)."""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

import torch

from gpulab.monitor.record.frames import generated_code_dirs

GPULAB = Path(__file__).resolve().parents[2] / "src" / "gpulab"
# the profiler's own code (gpulab's trainer, profiled, is the user's)
PROFILERS = [GPULAB / "monitor", GPULAB / "memory", GPULAB / "compiler.py"]
NOT_USERS = [Path(torch.__file__).parent, Path(sysconfig.get_paths()["stdlib"]), *map(Path, generated_code_dirs())]


def read_report(out: Path) -> dict:
    """out/report.json, its lines checked."""
    report = json.loads((Path(out) / "report.json").read_text())
    for where in lines_named(report):
        assert where_is_the_users(where), f"the report names a line that is not the script's: {where}"
    return report


def lines_named(report: dict) -> list[str]:
    found = [f.get("where") for f in report.get("findings", [])]
    compiled = report.get("compile") or {}
    for kind in ("recompiles", "graph_breaks", "cudagraph_skips", "cudagraph_rerecords"):
        found += [group.get(key) for group in compiled.get(kind, []) for key in ("where", "defined_at")]
    return [w for w in found if w]


def where_is_the_users(where: str) -> bool:
    path, _, line = where.rpartition(":")
    if not line.isdigit() or path.startswith("<"):
        return True  # not a file's line ("python -c", a rank's summary): nothing to place
    real = Path(os.path.realpath(path))
    return not any(real == root or root in real.parents for root in map(_real, PROFILERS + NOT_USERS))


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))
