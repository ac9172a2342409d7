"""`gpulab profile --try`: changes that cannot be measured are refused in one line, not measured.

Most tests here stop before any job runs; one runs the script as it is (a few seconds) to learn
that its DataLoader has no workers.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from gpulab.cli import main
from gpulab.errors import UserError
from gpulab.monitor.parent import trial
from tests.conftest import assert_one_line_error, run_cli

SCRIPTS = Path(__file__).parent / "scripts"


@pytest.fixture
def two_cores(monkeypatch):
    monkeypatch.setattr(trial, "usable_cores", lambda: 2)


def test_more_workers_than_the_cores_can_run_is_refused_before_anything_runs(two_cores, tmp_path, capsys):
    out = tmp_path / "try"
    code, _, err = run_cli(["profile", "--out", str(out), "--try", "num_workers=100000", "--",
                            sys.executable, "no_such_script.py"], capsys)
    assert_one_line_error(code, err, "--try num_workers=100000: this machine has 2 usable cores, and more than 8 "
                                     "workers (4 per core) only compete for them: try num_workers=1")
    assert not out.exists()


def test_up_to_four_workers_per_core_may_be_tried(two_cores):
    assert trial.parse_overrides(["num_workers=8"]) == {"num_workers": 8}
    with pytest.raises(UserError, match="num_workers=9"):
        trial.parse_overrides(["num_workers=9"])


@pytest.mark.parametrize("item", ["prefetch_factor=4", "persistent_workers=true"])
def test_a_worker_setting_with_no_workers_tried_is_refused_at_once(two_cores, item):
    key = item.partition("=")[0]
    with pytest.raises(UserError, match=f"--try {item} with num_workers=0: {key} only acts with num_workers > 0: "
                                        f"try it with --try num_workers=1"):
        trial.parse_overrides(["num_workers=0", item])


def loader(num_workers: int) -> dict:
    return {"type": "loader", "where": "train.py:12", "dataset": "Images", "batch_size": 32,
            "num_workers": num_workers, "pin_memory": False, "persistent_workers": False}


def test_a_worker_setting_acts_where_a_loader_has_workers_or_workers_are_tried_with_it(two_cores):
    trial.check_change_acts({"prefetch_factor": 4}, [loader(0), loader(2)])
    trial.check_change_acts({"prefetch_factor": 4, "num_workers": 2}, [loader(0)])
    trial.check_change_acts({"pin_memory": True}, [loader(0)])  # needs no workers
    with pytest.raises(UserError, match="the DataLoader at train.py:12 has num_workers=0"):
        trial.check_change_acts({"prefetch_factor": 4}, [loader(0)])


def test_prefetch_factor_on_a_loader_without_workers_is_refused_not_measured(two_cores, tmp_path, capfd):
    """slow_dataset.py's DataLoader has num_workers=0: DataLoader ignores prefetch_factor there, so a
    ratio of the two runs would only measure noise. The folders made for the output go again."""
    out = tmp_path / "new" / "nested" / "try"
    code = main(["profile", "--out", str(out), "--try", "prefetch_factor=4", "--steps", "3", "--",
                 sys.executable, str(SCRIPTS / "slow_dataset.py")])
    err = capfd.readouterr().err
    assert code == 2
    line = err.splitlines()[-1]
    assert line.startswith("gpulab: error: --try prefetch_factor=4: prefetch_factor only acts with num_workers > 0, "
                           "and the DataLoader at ")
    assert "slow_dataset.py:" in line
    assert line.endswith("has num_workers=0: try both, --try num_workers=1 --try prefetch_factor=4")
    assert "the change makes each step" not in err
    assert not (tmp_path / "new").exists()  # refused part-way: nothing written, no empty folder left


@pytest.mark.parametrize("script, args, said", [
    ("failing.py", ["--try", "threads=1", "--steps", "10"],
     "the run as it is failed (exit code 1) after 6 steps, before its 2 steps of warm-up and 10 measured (--steps "
     "10): see why with gpulab profile -- "),
    ("manual_sgd.py", ["--try", "threads=1", "--steps", "50"],
     "the script ended after 40 steps, before its 2 steps of warm-up and 50 measured (--steps 50): use --steps 38 "
     "or fewer"),
    ("manual_sgd.py", ["--try", "num_workers=1", "--steps", "5"],
     "--try num_workers=1: the script iterated no DataLoader in the run as it is, so a DataLoader setting changes "
     "nothing there"),
])
def test_a_run_that_cannot_measure_the_change_is_refused_after_it(script, args, said, two_cores, tmp_path, capfd):
    """A run that fails, one that ends before its steps (manual_sgd.py has 40), and a DataLoader
    setting for a script without a DataLoader: one line after the run as it is, no second run,
    nothing written."""
    out = tmp_path / "try"
    code = main(["profile", "--out", str(out), *args, "--", sys.executable, str(SCRIPTS / script)])
    err = capfd.readouterr().err
    assert code == 2, err
    assert said in err.splitlines()[-1], err.splitlines()[-1]
    assert not out.exists()


def test_a_setting_is_tried_once_and_a_number_is_ascii_digits(two_cores):
    with pytest.raises(UserError, match=r"--try threads=1: threads is given twice: try one value at a time"):
        trial.parse_overrides(["threads=2", "threads=1"])
    with pytest.raises(UserError, match="--try num_workers=\u00b2: num_workers is a whole number"):
        trial.parse_overrides(["num_workers=\u00b2"])  # a digit to str.isdigit, not to int()


def test_trial_options_without_try_are_refused(tmp_path, capsys):
    code, _, err = run_cli(["profile", "--steps", "3", "--max-pairs", "9", "--out", str(tmp_path / "p"), "--",
                            sys.executable, str(SCRIPTS / "manual_sgd.py")], capsys)
    assert_one_line_error(code, err, "--steps and --max-pairs only apply with --try: add --try KEY=VALUE to measure "
                                     "a change, or drop them")
    assert not (tmp_path / "p").exists()


# ----------------------------------------------------------------------------- pairs of runs


def try_noise(tmp_path: Path, factors: str, items: list[str], monkeypatch, max_pairs: int = 3) -> tuple[dict, list]:
    """--try on run_to_run_noise.py, whose runs take RUN_FACTORS x 30 ms per step in turn."""
    log = tmp_path / "runs.log"
    monkeypatch.setenv("RUN_FACTORS", factors)
    monkeypatch.setenv("RUN_LOG", str(log))
    out = tmp_path / "try"
    args = [arg for item in items for arg in ("--try", item)]
    code = main(["profile", "--out", str(out), *args, "--steps", "4", "--max-pairs", str(max_pairs), "--",
                 sys.executable, str(SCRIPTS / "run_to_run_noise.py")])
    assert code == 0
    runs = [line.split() for line in log.read_text().splitlines()]
    return json.loads((out / "try.json").read_text()), runs


def test_runs_alternate_in_pairs_stop_once_the_ratios_agree_and_threads_are_forced_in_the_changed_ones(
        tmp_path, monkeypatch, two_cores):
    """Every run sleeps the same, so two pairs agree. The script sets 2 threads itself; --try
    threads=1 makes it 1 in the changed runs only."""
    jobs, run_job = [], trial.run_job
    monkeypatch.setattr(trial, "run_job", lambda *args: jobs.append(run_job(*args)) or jobs[-1])
    result, runs = try_noise(tmp_path, "1", ["threads=1"], monkeypatch)
    assert [int(r[1]) for r in runs] == [2, 1, 1, 2]  # as is, changed; changed, as is
    # each run measures steps only: none inside a measurement window, whose profiler slows it
    assert [sum(s.get("profiled", False) for lane in job.lanes for s in lane.steps) for job in jobs] == [0, 0, 0, 0]
    assert result["reliable"] and len(result["pairs"]) == 2
    assert result["speedup"] == pytest.approx(1.0, abs=0.08)
    assert result["spread"][0] <= result["speedup"] <= result["spread"][1]
    assert result["overrides"] == {"threads": 1}


def test_runs_that_disagree_are_called_not_reliable_with_their_spread(tmp_path, monkeypatch, capsys):
    """Runs 1..4 sleep 2, 1, 2, 1 x 30 ms: pairs (as is, changed), (changed, as is) give ratios 2.0
    and 0.5, faster in one pair and slower in the other: no answer after --max-pairs 2, however
    the steps inside each run agree."""
    result, runs = try_noise(tmp_path, "2,1,2,1", ["num_workers=1"], monkeypatch, max_pairs=2)
    assert [float(r[0]) for r in runs] == [2, 1, 2, 1]
    assert not result["reliable"]
    ratios = result["pairs"]
    assert ratios == pytest.approx([2.0, 0.5], rel=0.15)
    # the verdict prints the measured ratios to 2 places, result["pairs"] keeps 4: 1.8949 prints
    # as 1.89, its 1.895 as 1.90
    said = re.match(r"not reliable: spread ([\d.]+)x \.\. ([\d.]+)x over 2 pairs", result["verdict"])
    assert said, result["verdict"]
    assert float(said[1]) == pytest.approx(min(ratios), abs=0.006) and float(said[2]) == pytest.approx(max(ratios), abs=0.006)
    assert "not reliable" in capsys.readouterr().err


def test_a_trial_under_torchrun_is_named_after_the_script_torchrun_starts(two_cores, tmp_path, monkeypatch, capsys):
    """As `gpulab profile` names its folder: profiles/<time>-train, not after the launcher's options."""
    (tmp_path / "train.py").write_text("")
    monkeypatch.chdir(tmp_path)
    folders = []

    def stop_before_running(self, change, label, max_pairs):
        folders.append(self.out)
        raise UserError("stopped before the runs")

    monkeypatch.setattr(trial._Trial, "run_until_stable", stop_before_running)
    code, _, err = run_cli(["profile", "--try", "num_workers=1", "--steps", "3", "--", sys.executable, "-m",
                            "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "train.py"], capsys)
    assert_one_line_error(code, err, "stopped before the runs")
    assert folders[0].parent == Path("profiles") and folders[0].name.endswith("-train"), folders


def test_more_threads_than_cores_are_refused(two_cores):
    with pytest.raises(UserError, match=r"--try threads=3: this machine has 2 usable cores.*try threads=1 \.\. 2"):
        trial.parse_overrides(["threads=3"])
    with pytest.raises(UserError, match="threads is a whole number of 1 or more"):
        trial.parse_overrides(["threads=0"])


def test_ratios_agree_within_a_tenth_of_their_median():
    assert not trial.stable([1.0])
    assert trial.stable([1.0, 1.05])
    assert not trial.stable([1.16, 1.91])
    assert trial.stable([1.16, 1.91, 1.99, 1.95, 1.97])  # the latest three agree
    assert not trial.stable([1.91, 1.16, 1.99])


def test_pairs_that_disagree_in_size_but_not_in_direction_say_so():
    assert trial.unreliable_verdict([1.06, 1.88, 1.31, 1.2, 1.5]).startswith(
        "not reliable in size: spread 1.06x .. 1.88x over 5 pairs of runs, but faster in every pair")
    assert "slower in every pair" in trial.unreliable_verdict([0.5, 0.9, 0.7])
    assert trial.unreliable_verdict([1.0, 2.0, 0.5]).startswith("not reliable: spread 0.50x .. 2.00x over 3 pairs")
