"""scripts/gpu_check.py on this machine: without a GPU it runs the CPU-safe checks and says how
many it skipped; it never reports a GPU check as passed where there is no GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU run")
def test_without_a_gpu_the_gpu_checks_are_skipped_and_counted(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    record = json.loads((tmp_path / "gpu_check.json").read_text())
    by_status = {}
    for check in record["checks"]:
        by_status.setdefault(check["status"], []).append(check["name"])
    skipped = by_status.get("skipped", [])
    assert f"no GPU: {len(skipped)} checks skipped" in done.stdout
    assert set(by_status) <= {"pass", "skipped"}, by_status  # the CPU-safe checks pass here
    assert by_status.get("pass") == ["devices"]
    assert all(c["seen"].startswith("needs ") for c in record["checks"] if c["status"] == "skipped")
    assert done.returncode == 0, done.stdout


def test_an_unknown_check_name_is_a_one_line_error(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--out", str(tmp_path),
                           "--only", "nope"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "unknown check(s) ['nope']" in done.stderr and "Traceback" not in done.stderr
