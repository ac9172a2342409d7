"""Every Python snippet in README.md runs as given (issue 16: snippets that failed as printed), and the
figures it quotes from committed results are those results' (issue 44: one results table per device class,
the measurements' history moved to docs/benchmarks.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
BENCHMARKS_MD = (ROOT / "docs" / "benchmarks.md").read_text()
SNIPPETS = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def lines_citing(text: str, cited: str) -> list[str]:
    """The lines (a results table's rows) that name a result file."""
    return [line for line in text.splitlines() if cited in line]


def test_the_readme_has_python_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", range(len(SNIPPETS)))
def test_readme_snippet_runs_as_given(tmp_path, index):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", SNIPPETS[index]], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"README snippet {index + 1} failed:\n{SNIPPETS[index]}\n{done.stderr[-2000:]}"
    # What a snippet prints of its results is what the README quotes (the own-model example's
    # "cpu: final train loss ..." lines): figures that reproduce, not figures from another run.
    for line in done.stdout.splitlines():
        if ": final train loss" in line:
            assert line.strip() in README, f"the README does not quote what snippet {index + 1} printed: {line}"


PLAN_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*/plan-*/plan.json"))


@pytest.mark.parametrize("path", PLAN_RESULTS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_the_plan_figures_are_the_committed_results(path):
    """Every predicted-vs-measured figure quoted from `gpulab plan --check` is the one in the committed
    plan.json it names (issue 16: figures that come from a result file). docs/benchmarks.md, where the
    README's measurements moved, quotes every row; a README results row quotes only that file's errors
    and samples/s, and a range of errors is the file's smallest to largest."""
    plan = json.loads(path.read_text())
    cited = str(path.relative_to(ROOT))
    readme_rows = lines_citing(README, cited)
    if cited not in BENCHMARKS_MD and not readme_rows:
        pytest.skip(f"{cited} is cited neither in the README nor in docs/benchmarks.md")
    if cited in BENCHMARKS_MD:
        for row in plan["check"]:
            for figure in (f"{row['predicted_samples_per_s']:,.0f}", f"{row['measured_samples_per_s']:,.0f}",
                           f"{row['error']:+.1%}"):
                assert figure in BENCHMARKS_MD, f"{row['name']}: {figure} from {cited} is not in docs/benchmarks.md"
    errors = {f"{row['error']:+.1%}" for row in plan["check"]}
    samples = {f"{row[key]:,.0f}" for row in plan["check"]
               for key in ("predicted_samples_per_s", "measured_samples_per_s")}
    lowest, highest = (f"{f(row['error'] for row in plan['check']):+.1%}" for f in (min, max))
    for line in readme_rows:
        quoted = re.findall(r"[+-]\d+\.\d%", line)
        assert quoted, f"the README's row naming {cited} quotes none of its errors"
        for figure in quoted:
            assert figure in errors, f"README: {figure} is not an error in {cited} ({sorted(errors)})"
        for figure in re.findall(r"\d{1,3}(?:,\d{3})+", line):
            assert figure in samples, f"README: {figure} samples/s is not in {cited}"
        for low, high in re.findall(r"([+-]\d+\.\d%) \.\. ([+-]\d+\.\d%)", line):
            assert (low, high) == (lowest, highest), f"README: the range of errors from {cited} is {lowest} .. {highest}"


TRAIN_SPEED = ROOT / "benchmarks" / "results" / "cpu-amd-epyc-2core" / "train_speed.json"


def test_the_train_speed_figures_are_the_committed_results():
    """The "speed vs the textbook" table (docs/benchmarks.md's since the README's measurements moved
    there) quotes the committed train_speed.json: each contender's median samples/s and ratio, and the
    ratio's range over the rounds. The README's results row naming it quotes the textbook's and gpulab's
    default figures from it."""
    result = json.loads(TRAIN_SPEED.read_text())
    cited = str(TRAIN_SPEED.relative_to(ROOT))
    rounds = f"{len(result['rounds'])} rounds"
    assert cited in BENCHMARKS_MD
    assert rounds in BENCHMARKS_MD
    for name, row in result["rows"].items():
        figures = [f"{row['samples_per_s']:,.0f}", f"{row['ratio_vs_textbook']:.2f}x"]
        if row["ratio_min"] != row["ratio_max"]:  # the baseline is 1.00x in every round, by definition
            figures.append(f"[{row['ratio_min']:.2f} .. {row['ratio_max']:.2f}]")
        for figure in figures:
            assert figure in BENCHMARKS_MD, f"{name}: {figure} from train_speed.json is not in docs/benchmarks.md"
    readme_rows = lines_citing(README, cited)
    assert readme_rows, "the README's results table does not name train_speed.json"
    textbook = next(row for name, row in result["rows"].items() if name.startswith("textbook"))
    default = next(row for name, row in result["rows"].items() if "default" in name)
    for line in readme_rows:
        for figure in (f"{textbook['samples_per_s']:,.0f}", f"{default['samples_per_s']:,.0f}",
                       f"{default['ratio_vs_textbook']:.2f}x", f"[{default['ratio_min']:.2f} .. {default['ratio_max']:.2f}]",
                       rounds):
            assert figure in line, f"README: {figure} from train_speed.json is not in its row"


TRAINING_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*/training*.json"))


@pytest.mark.parametrize("path", TRAINING_RESULTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_readme_s_training_figures_are_the_committed_results(path):
    """A README results row naming a committed `gpulab bench training` result quotes it: the textbook's
    and `gpulab train`'s whole process (medians over the rounds) and gpulab train's ratio to the
    textbook with its range over the rounds - per epoch in the results made before the benchmark
    had first and second runs, in seconds of each run since."""
    cited = str(path.relative_to(ROOT))
    readme_rows = lines_citing(README, cited)
    if not readme_rows:
        pytest.skip(f"{cited} is not cited in the README")
    for device, per_device in json.loads(path.read_text())["summary"]["devices"].items():
        runs = [per_device[kind] for kind in ("first", "second")] if "first" in per_device else [per_device]
        for contenders in runs:
            textbook, gpulab = contenders["textbook"], contenders["gpulab train"]
            seconds = ((lambda row: f"{row['wall_s']:.1f} s") if "first" in per_device
                       else (lambda row: f"{row['epoch_s']:#.3g}"))
            for line in readme_rows:
                for figure in (seconds(textbook), seconds(gpulab), f"{gpulab['ratio']:.2f}x",
                               f"[{gpulab['ratio_min']:.2f} .. {gpulab['ratio_max']:.2f}]"):
                    assert figure in line, f"README: {figure} ({device}) from {cited} is not in its row"


H100_WHOLE_PROCESSES = ROOT.parent / "shared" / "evidence" / "gpu-h100-2026-11-28" / "speed-side-by-side.log"


def test_the_readme_s_whole_process_gpu_figures_are_the_evidence_s():
    """The README's GPU row on whole processes (and its open problem: a user waits longer for gpulab
    train than for the textbook's script) quotes the H100 evidence it names: each contender's wall clock
    in both rounds, and its 10th epoch's samples/s, attributed to the right contender."""
    if not H100_WHOLE_PROCESSES.exists():
        pytest.skip("../shared/evidence is not beside this checkout")
    log = H100_WHOLE_PROCESSES.read_text()
    walls = re.findall(r"^WALL (\d+\.\d+) s", log, flags=re.M)
    speeds = [f"{int(s.replace(',', '')):,}" for s in re.findall(r"^epoch 10\S* .*?([\d,]+) samples/s", log, flags=re.M)]
    assert len(walls) == len(speeds) == 6, "the log no longer holds 2 rounds of textbook, gpulab train, --compile graphs"
    readme_rows = lines_citing(README, "gpu-h100-2026-11-28/speed-side-by-side.log")
    assert readme_rows, "the README's GPU table does not name the H100 evidence"
    for line in readme_rows:
        for contender in range(3):  # in each round: the textbook, gpulab train, gpulab train --compile graphs
            for figures, unit in ((walls, " s"), (speeds, "")):
                pair = f"{figures[contender]}{unit} and {figures[contender + 3]}{unit}"
                assert pair in line, f"README: {pair} from the H100 evidence is not in its row"
