"""gpulab profile on a long job of tiny steps: is its cost bounded? (issue 27)

A script trains a 4-input linear model for --seconds (tiny steps: ~50-100 us each, so a 5-minute
job is millions of steps: the worst case for a recorder that keeps every step). Run under
`gpulab profile`, this measures what gpulab itself takes, polled every 0.2 s:
  - the peak resident memory of gpulab's own process (the parent: sampler, hang watch, report),
  - the peak size of the raw recordings on disk (the events folder under --out),
  - the time from the script's last step to gpulab's exit (reading the recordings, the report),
  - the sizes of report.json, timeline.png and trace.json,
and the steps the script counted itself against the steps the report says.

    flock /tmp/gpulab-cpu.lock python benchmarks/profile_long_run.py --seconds 300
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from gpulab.io import git_commit

SCRIPT = """
import json, sys, time
import torch
seconds, truth = float(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
steps, until = 0, time.monotonic() + seconds
while time.monotonic() < until:
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    steps += 1
with open(truth, "w") as f:
    json.dump({"steps": steps, "ended_unix": time.time()}, f)
"""


def folder_bytes(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        try:
            total += path.stat().st_size if path.is_file() else 0
        except OSError:
            pass
    return total


def run(seconds: float, work: Path) -> dict:
    script, truth, out = work / "tiny_steps.py", work / "truth.json", work / "prof"
    script.write_text(SCRIPT)
    started = time.time()
    gpulab = subprocess.Popen([sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--",
                               sys.executable, str(script), str(seconds), str(truth)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    me = psutil.Process(gpulab.pid)
    peak_rss, peak_disk = 0, 0
    while gpulab.poll() is None:
        try:
            peak_rss = max(peak_rss, me.memory_info().rss)
        except psutil.Error:
            pass
        if out.exists():
            peak_disk = max(peak_disk, sum(folder_bytes(p) for p in out.glob(".events-*")))
        time.sleep(0.2)
    output = gpulab.stdout.read()
    ended = time.time()
    if gpulab.returncode != 0:
        raise SystemExit(f"gpulab profile failed ({gpulab.returncode}):\n{output[-3000:]}")
    counted = json.loads(truth.read_text())
    report = json.loads((out / "report.json").read_text())
    return {
        "seconds": seconds,
        "steps_counted_by_the_script": counted["steps"],
        "steps_in_the_report": report["steps"],
        "gpulab_peak_rss_mib": round(peak_rss / 2**20, 1),
        "events_on_disk_peak_mib": round(peak_disk / 2**20, 2),
        "report_time_s": round(ended - counted["ended_unix"], 2),
        "outputs_kib": {name: round((out / name).stat().st_size / 1024, 1)
                        for name in ("report.json", "timeline.png", "trace.json")},
        "wall_s": round(ended - started, 1),
        "later_steps": report.get("later_steps"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=300.0, help="how long the script trains")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    commit = git_commit()  # of the code that runs (the tree may change while it runs)
    with tempfile.TemporaryDirectory(prefix="gpulab-long-") as work:
        result = run(args.seconds, Path(work))
    result["commit"] = commit
    result["cores"] = os.cpu_count()
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
