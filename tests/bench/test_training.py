"""`gpulab bench training`'s figures of what a user feels: the whole process on a first run (empty
caches) and a second, the time to the first step, the steady epoch and the time to 0.90 test
accuracy, computed from hand-made rows."""

from __future__ import annotations

import pytest
import torch

from gpulab.bench import training
from gpulab.bench.result import Result
from gpulab.bench.runner import Context


def metrics_row(train, acc, wall, evaluation=0.5, compile_s=0.0, **extra):
    """A row of `gpulab train`'s metrics.json, as much of it as the benchmark reads."""
    return {"train_seconds": train, "eval_seconds": evaluation, "compile_seconds": compile_s, "test_acc": acc,
            "wall_s": wall, **extra}


def test_time_to_accuracy_is_the_end_of_the_first_epoch_that_reached_it():
    walls = [10.0, 20.0, 30.0, 40.0]
    assert training.time_to_accuracy(walls, [0.85, 0.91, 0.89, 0.93]) == 20.0  # the first, not a later one
    assert training.time_to_accuracy(walls, [0.85, 0.899, 0.90, 0.95]) == 30.0  # 0.90 itself reaches 0.90
    assert training.time_to_accuracy(walls, [0.5, 0.6, 0.7, 0.8]) is None  # never: "not reached"
    assert training.time_to_accuracy(walls, [None, None, 0.95, 0.95]) == 30.0  # epochs without an accuracy
    assert training.time_to_accuracy(walls, [0.85, 0.86, 0.87, 0.88], target=0.87) == 30.0
    with pytest.raises(ValueError):
        training.time_to_accuracy(walls, [0.95])  # an accuracy for each epoch's end, or a bug upstream


def test_the_steady_epoch_leaves_the_first_out():
    assert training.steady_epoch([9.0, 3.0, 5.0, 4.0]) == 4.0  # the median of 3, 5, 4: not of all four
    assert training.steady_epoch([9.0, 3.0]) == 3.0
    assert training.steady_epoch([9.0]) is None  # one epoch: none after the first


def test_a_gpulab_run_s_figures_from_its_metrics_rows():
    rows = [metrics_row(6.0, 0.85, 12.5, compile_s=2.0, first_step_s=5.25), metrics_row(4.0, 0.89, 17.0),
            metrics_row(3.0, 0.905, 21.0), metrics_row(5.0, 0.91, 26.5)]
    ran = training.gpulab_figures(rows, wall=28.0)
    assert ran["first_step_s"] == 5.25 and ran["to_acc_s"] == 21.0
    assert ran["steady_s"] == 4.0 and ran["train_s"] == 4.5 and ran["eval_s"] == 0.5
    assert ran["compile_s"] == 2.0 and ran["rest_s"] == 28.0 - 18.0 - 2.0 - 2.0
    assert (ran["wall_s"], ran["test_acc"], ran["epochs"]) == (28.0, 0.91, 4)


def test_a_gpulab_run_that_never_reaches_0_90_and_one_that_resumed():
    """The first step's row is the first epoch this process trained: a resumed run's is not the
    first row."""
    rows = [metrics_row(6.0, 0.80, 12.0), metrics_row(4.0, 0.85, 17.0, first_step_s=14.0)]
    ran = training.gpulab_figures(rows, wall=18.0)
    assert ran["to_acc_s"] is None and ran["first_step_s"] == 14.0


def test_the_textbook_s_figures_from_its_json_line():
    told = {"train_seconds": [15.0, 14.0, 16.0], "eval_seconds": [1.0, 1.0, 1.0], "test_acc": [0.7, 0.8, 0.92],
            "wall_s": [18.0, 33.0, 50.0], "first_step_s": 2.5}
    ran = training.script_figures(told, wall=51.0)
    assert (ran["first_step_s"], ran["to_acc_s"], ran["steady_s"]) == (2.5, 50.0, 15.0)
    assert ran["test_acc"] == 0.92 and ran["compile_s"] == 0.0 and ran["rest_s"] == 51.0 - 45.0 - 3.0
    told["test_acc"] = [0.7, 0.8, 0.85]
    assert training.script_figures(told, wall=51.0)["to_acc_s"] is None


def test_a_time_some_rounds_never_reached_counts_as_longer_than_any():
    assert training.over_rounds([12.0, 10.0, 14.0]) == (12.0, 10.0, 14.0)
    assert training.over_rounds([12.0, None, 14.0]) == (14.0, 12.0, None)  # the median: 12, 14, never
    assert training.over_rounds([12.0, None, None]) == (None, 12.0, None)
    assert training.over_rounds([None, None]) == (None, None, None)


def run_figures(wall, first_step, to_acc, train=(4.0, 3.0), acc=0.9):
    ran = training.figures(wall, list(train), [0.5] * len(train), 0.0, acc)
    return {**ran, "first_step_s": first_step, "to_acc_s": to_acc}


def test_compare_gives_each_new_figure_its_median_and_range_over_the_rounds():
    runs = {training.TEXTBOOK: [run_figures(60.0, 2.0, None), run_figures(50.0, 3.0, None), run_figures(55.0, 2.5, 54.0)],
            training.DEFAULT: [run_figures(20.0, 5.0, 15.0), run_figures(25.0, 4.0, 18.0), run_figures(22.0, 6.0, 16.0)]}
    rows = training.compare(runs, epochs=2)
    ours, theirs = rows[training.DEFAULT], rows[training.TEXTBOOK]
    assert (ours["wall_s"], ours["wall_s_min"], ours["wall_s_max"]) == (22.0, 20.0, 25.0)
    assert (ours["ratio"], ours["ratio_min"], ours["ratio_max"]) == (2.5, 2.0, 3.0)  # 60/20, 50/25, 55/22
    assert (ours["first_step_s"], ours["first_step_s_min"], ours["first_step_s_max"]) == (5.0, 4.0, 6.0)
    assert (ours["to_acc_s"], ours["to_acc_rounds"], ours["rounds"]) == (16.0, 3, 3)
    assert (theirs["to_acc_s"], theirs["to_acc_s_min"], theirs["to_acc_rounds"]) == (None, 54.0, 1)
    assert ours["steady_s"] == 3.0
    assert training.to_accuracy_cell(ours) == "16 s"
    assert training.to_accuracy_cell(theirs) == "not reached (reached in 1/3 rounds)"
    assert training.to_accuracy_cell({**theirs, "to_acc_rounds": 0}) == "not reached"
    assert training.to_accuracy_cell({**ours, "to_acc_rounds": 2}) == "16 s (2/3 rounds)"


def summary_rows(first, second):
    """summary[spec] with the textbook's and gpulab train's rows: (wall, ratio range, first step, to 0.90)."""
    def row(name, wall, ratios, first_step, to_acc):
        ratio, low, high = ratios
        return {"contender": name, "wall_s": wall, "ratio": ratio, "ratio_min": low, "ratio_max": high,
                "first_step_s": first_step, "to_acc_s": to_acc}

    return {kind: {training.TEXTBOOK: row(training.TEXTBOOK, *textbook), training.DEFAULT: row(training.DEFAULT, *gpulab),
                   training.COMPILED: row(training.COMPILED, 1.0, (99.0, 99.0, 99.0), 0.1, 0.2)}
            for kind, (textbook, gpulab) in ((training.FIRST, first), (training.SECOND, second))} | {"floor": {}}


def test_the_headline_is_the_demo_s_whole_process_first_and_second_run_against_the_textbook():
    rows = summary_rows(first=((171.0, (1, 1, 1), 2.04, None), (52.1, (3.28, 3.01, 3.4), 6.2, 15.2)),
                        second=((170.0, (1, 1, 1), 1.9, None), (48.0, (3.54, 3.3, 3.61), 3.1, 12.0)))
    assert training.headline("cpu", rows) == (
        "cpu: gpulab train vs the textbook, whole process: first run (empty caches) 52.1 s vs 171 s, "
        "3.28x [3.01 .. 3.40]; second run 48 s vs 170 s, 3.54x [3.30 .. 3.61]; "
        "to the first step 6.2 s vs 2.04 s (second run 3.1 s vs 1.9 s); "
        "to test acc 0.90 15.2 s vs not reached (second run 12 s vs not reached)")


def test_the_headline_sets_gpulab_train_beside_the_script_by_hand():
    rows = summary_rows(first=((171.0, (1, 1, 1), 2.04, None), (52.1, (3.28, 3.01, 3.4), 6.2, 15.2)),
                        second=((170.0, (1, 1, 1), 1.9, None), (48.0, (3.54, 3.3, 3.61), 3.1, 12.0)))
    for kind, wall, acc in ((training.FIRST, 57.31, 0.904), (training.SECOND, 43.2, 0.9041)):
        rows[kind][training.BY_HAND] = {"contender": training.BY_HAND, "wall_s": wall, "test_acc": acc}
        rows[kind][training.DEFAULT]["test_acc"] = 0.908
    assert training.headline("cpu", rows).endswith(
        "; vs plain PyTorch by hand, whole process: first run 52.1 s vs 57.3 s (1.10x), test acc 0.908 vs 0.904; "
        "second run 48 s vs 43.2 s (0.90x), test acc 0.908 vs 0.904")


class FakeRuns:
    """run_once's stand-in: records where each run found its caches and leaves something in them,
    as a compiler would; a first run takes 100 s, a second 50 s."""

    def __init__(self):
        self.calls = []

    def __call__(self, command, epochs, spec, data_dir, out, timeout_s, cache=None):
        found = sorted(p.name for p in cache.iterdir())
        self.calls.append({"contender": command[-1], "out": out, "cache": cache, "found": found})
        (cache / f"compiled-{len(found)}").write_text("kernels")
        second = bool(found)
        wall = 50.0 if second else 100.0
        return training.figures(wall, [wall / 4] * epochs, [1.0] * epochs, 0.0, 0.9, first_step_s=wall / 10,
                                epoch_walls=[wall] * epochs, accuracies=[0.9] * epochs)


def test_each_round_runs_every_contender_first_on_an_empty_cache_then_again_on_what_it_left(monkeypatch, tmp_path):
    fake = FakeRuns()
    monkeypatch.setattr(training, "run_once", fake)
    monkeypatch.setattr(training, "data_folder", lambda folder, samples: tmp_path)
    monkeypatch.setattr(training.data, "load", lambda folder: ([0] * 1000, []))
    monkeypatch.setattr(training, "_floor", lambda result, device, samples: {})
    result = Result(name="training", lesson="", config={}, env={}, preset="tiny")
    cfg = training.Config(epochs=2, rounds=2, compiled=False)
    training.run(cfg, Context(devices=[torch.device("cpu")]), result)

    contenders = [training.TEXTBOOK, training.BY_HAND, training.DEFAULT]
    one_round = ["gpulab.bench.textbook"] * 2 + [training.BY_HAND_SCRIPT[-1]] * 2 + ["cpu"] * 2
    assert [c["contender"] for c in fake.calls] == one_round * 2
    for first, second in zip(fake.calls[::2], fake.calls[1::2]):
        assert first["found"] == [] and second["found"] == ["compiled-0"]  # empty, then what the first left
        assert first["cache"] == second["cache"] and first["out"] != second["out"]
    assert len({c["cache"] for c in fake.calls}) == 6  # a new folder for every first run
    assert not any(c["cache"].exists() for c in fake.calls)  # removed with the benchmark's temporary folder

    device = result.summary["devices"]["cpu"]
    for kind, wall in ((training.FIRST, 100.0), (training.SECOND, 50.0)):
        assert set(device[kind]) == set(contenders)
        for name in contenders:
            row = device[kind][name]
            assert (row["wall_s"], row["first_step_s"], row["to_acc_s"], row["rounds"]) == (wall, wall / 10, wall, 2)
    assert "first run (empty caches) 100 s vs 100 s, 1.00x" in result.summary["headline"]
    assert "second run 50 s vs 50 s, 1.00x" in result.summary["headline"]
    assert "vs plain PyTorch by hand, whole process: first run 100 s vs 100 s (1.00x)" in result.summary["headline"]
    assert result.summary["target_acc"] == 0.90
    assert [r["wall_s"] for r in device["runs"][training.SECOND][training.DEFAULT]] == [50.0, 50.0]  # round by round
    for key in ("training", "training-parts"):
        assert [(r["run"], r["contender"]) for r in result.tables[key].rows] == [
            (kind, name) for kind in (training.FIRST, training.SECOND) for name in contenders]
    # the whole process as a Timing in each row: what `gpulab bench`'s JSON keeps of every benchmark
    assert [(r["time"]["median_s"], r["time"]["repeats"]) for r in result.tables["training"].rows] == [(100.0, 2)] * 3 + [(50.0, 2)] * 3
    assert sum("trained 2 epoch(s)" in c.what for c in result.checks) == 12
    import matplotlib.pyplot as plt

    plt.close(training.plot(result))  # a bar per contender and run


def test_a_contender_s_caches_are_all_in_its_folder(monkeypatch, tmp_path):
    from gpulab.io import cache_dir

    folder = tmp_path / "cache"
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/warm")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", str(cache_dir() / "pycache"))  # as gpulab's start-up sets it
    env = training.cache_env(folder)
    assert env["XDG_CACHE_HOME"] == str(folder) and env["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "torchinductor")
    assert "TRITON_CACHE_DIR" not in env  # torch puts Triton's under TORCHINDUCTOR_CACHE_DIR
    assert "PYTHONPYCACHEPREFIX" not in env  # gpulab's child sets its own, under the new XDG_CACHE_HOME
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/the/user/s/own")
    assert training.cache_env(folder)["PYTHONPYCACHEPREFIX"] == str(folder / "pycache")


def test_the_tiny_preset_runs_the_textbook_and_gpulab_train_only():
    """The suite's smoke run: the script by hand has its own test (test_by_hand.py), the compiled
    contenders theirs (test_compile.py)."""
    from gpulab import bench

    cfg = bench.config(training, "tiny")
    assert list(training.contenders(torch.device("cpu"), cfg.compiled, cfg.by_hand)) == [training.TEXTBOOK, training.DEFAULT]
    assert list(training.contenders(torch.device("cpu"))) == [training.TEXTBOOK, training.BY_HAND, training.DEFAULT]
