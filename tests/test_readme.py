"""Every Python snippet in README.md runs as given (issue 16: snippets that failed as printed)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


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
    readme = (ROOT / "README.md").read_text()
    for line in done.stdout.splitlines():
        if ": final train loss" in line:
            assert line.strip() in readme, f"the README does not quote what snippet {index + 1} printed: {line}"


PLAN_RESULTS = sorted((ROOT / "benchmarks" / "results").glob("*/plan-*/plan.json"))


@pytest.mark.parametrize("path", PLAN_RESULTS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_the_readme_s_plan_figures_are_the_committed_results(path):
    """Every predicted-vs-measured figure the README quotes from `gpulab plan --check` is the one
    in the committed plan.json it names (issue 16: figures that come from a result file)."""
    import json

    plan = json.loads(path.read_text())
    readme = (ROOT / "README.md").read_text()
    cited = str(path.relative_to(ROOT))
    if cited not in readme:
        pytest.skip(f"{cited} is not cited in the README")
    for row in plan["check"]:
        for figure in (f"{row['predicted_samples_per_s']:,.0f}", f"{row['measured_samples_per_s']:,.0f}",
                       f"{row['error']:+.1%}"):
            assert figure in readme, f"{row['name']}: {figure} from {cited} is not in README.md"


TRAIN_SPEED = ROOT / "benchmarks" / "results" / "cpu-amd-epyc-2core" / "train_speed.json"


def test_the_readme_s_train_speed_figures_are_the_committed_results():
    """The README's "speed vs the textbook" table quotes the committed train_speed.json: each
    contender's median samples/s and ratio, and the ratio's range over the rounds."""
    import json

    result = json.loads(TRAIN_SPEED.read_text())
    readme = (ROOT / "README.md").read_text()
    assert str(TRAIN_SPEED.relative_to(ROOT)) in readme
    assert f"{len(result['rounds'])} rounds" in readme
    for name, row in result["rows"].items():
        figures = [f"{row['samples_per_s']:,.0f}", f"{row['ratio_vs_textbook']:.2f}x"]
        if row["ratio_min"] != row["ratio_max"]:  # the baseline is 1.00x in every round, by definition
            figures.append(f"[{row['ratio_min']:.2f} .. {row['ratio_max']:.2f}]")
        for figure in figures:
            assert figure in readme, f"{name}: {figure} from train_speed.json is not in README.md"
