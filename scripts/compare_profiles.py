"""Profile the same planted scripts with two checkouts of gpulab, side by side: a refactor of the
profiler must give the same step counts (exactly) and the same phase shares and findings (within
the noise of two runs of one checkout).

    flock /tmp/gpulab-cpu.lock .venv/bin/python scripts/compare_profiles.py --before /path/to/old/src

Each case is profiled `--rounds` times with each checkout, alternating (before, after, before, ...),
so drift of a shared machine hits both alike. Printed per case: steps, steady steps, median step,
phase shares (medians over rounds) and the findings' causes, before | after, and the largest
difference in any phase share next to the spread between rounds of one checkout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "monitor" / "scripts"
PYTHON = sys.executable

# name -> the command after `gpulab profile --`: planted causes and step rules, on a CPU.
CASES = {
    "fast_dataset (compute-bound)": [PYTHON, str(SCRIPTS / "fast_dataset.py")],
    "slow_dataset (input pipeline)": [PYTHON, str(SCRIPTS / "slow_dataset.py")],
    "transforms_in_getitem": [PYTHON, str(SCRIPTS / "transforms_in_getitem.py")],
    "python_overhead": [PYTHON, str(SCRIPTS / "python_overhead.py")],
    "accumulate (fold into optimizer steps)": [PYTHON, str(SCRIPTS / "accumulate.py")],
    "manual_sgd (backward rule)": [PYTHON, str(SCRIPTS / "manual_sgd.py")],
    "inference_only": [PYTHON, str(SCRIPTS / "inference_only.py")],
    "trainers_in_children fork": [PYTHON, str(SCRIPTS / "trainers_in_children.py"), "fork"],
    "ddp 2 ranks, rank 1 slow data": [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                      str(SCRIPTS / "ddp_ranks.py"), "slow-data"],
    "gpulab train --devices cpu*2 (LeNet, 1 epoch)": [PYTHON, "-m", "gpulab", "train", "--devices", "cpu*2",
                                                           "--epochs", "1"],
}


def profile(src: Path, command: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    result = subprocess.run([PYTHON, "-m", "gpulab", "profile", "--out", str(out), "--", *command], env=env,
                            capture_output=True, text=True, cwd=out.parent)
    report = out / "report.json"
    if not report.is_file():
        sys.exit(f"no report from {src} for {' '.join(command)} (exit {result.returncode}):\n{result.stderr[-3000:]}")
    return json.loads(report.read_text())


def summary(report: dict) -> dict:
    processes = [p for p in report.get("processes", []) if p["steps"]]
    return {"steps": report["steps"], "steady": report["steady_steps"], "per_process": [p["steps"] for p in processes],
            "median_ms": report["step_time_s"]["median"] * 1e3, "phases": report["phases"],
            "causes": [f["cause"] for f in report["findings"]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="the src/ folder of the other checkout")
    parser.add_argument("--after", type=Path, default=ROOT / "src", help="default: this checkout's src/")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", nargs="+", help="cases whose name starts with one of these")
    args = parser.parse_args()
    trees = {"before": args.before.resolve(), "after": args.after.resolve()}
    print(f"before = {trees['before']}\nafter  = {trees['after']}\n{args.rounds} rounds, alternating\n")
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="gpulab-compare-") as tmp:
        for name, command in CASES.items():
            if args.only and not any(name.startswith(o) for o in args.only):
                continue
            runs: dict[str, list[dict]] = {"before": [], "after": []}
            for r in range(args.rounds):
                for label, src in trees.items():
                    runs[label].append(summary(profile(src, command, Path(tmp) / f"{len(os.listdir(tmp))}")))
            print(f"== {name}")
            for label, rows in runs.items():
                phases = {k: statistics.median(row["phases"][k] for row in rows) for k in rows[0]["phases"]}
                shown = "  ".join(f"{k} {v:.0%}" for k, v in phases.items() if v >= 0.005)
                print(f"  {label:<6} steps {[row['steps'] for row in rows]} per process {rows[0]['per_process']} "
                      f"steady {[row['steady'] for row in rows]} median {statistics.median(row['median_ms'] for row in rows):.2f} ms"
                      f"  {shown}  findings {rows[0]['causes']}")
            spread = max(abs(a["phases"][k] - b["phases"][k]) for rows in runs.values()
                         for a in rows for b in rows for k in a["phases"])
            diff = max(abs(statistics.median(row["phases"][k] for row in runs["before"])
                           - statistics.median(row["phases"][k] for row in runs["after"])) for k in runs["before"][0]["phases"])
            same_steps = [row["steps"] for row in runs["before"]] == [row["steps"] for row in runs["after"]]
            print(f"  largest phase difference before/after {diff:.1%} (spread within one checkout {spread:.1%}); "
                  f"step counts {'identical' if same_steps else 'DIFFER'}\n")
            worst = max(worst, diff)
    print(f"largest phase difference over all cases: {worst:.1%}")


if __name__ == "__main__":
    main()
