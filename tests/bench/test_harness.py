"""The timing harness and the equality checks every benchmark relies on."""

from __future__ import annotations

import pytest
import torch

from gpulab.bench.harness import ResultMismatch, check_close, measure, pick_clock, summarize


def test_measure_reports_median_within_the_spread():
    calls = []
    t = measure(lambda: calls.append(1), [torch.device("cpu")], repeats=5, min_sample_s=0.001, max_total_s=1.0)
    assert t.clock == "cpu"
    assert t.repeats == 5
    assert t.min_s <= t.median_s <= t.max_s
    assert t.iqr_s >= 0
    # calibration: a call of ~100 ns is repeated many times per sample
    assert t.inner > 1
    assert len(calls) >= t.inner * t.repeats


def test_measure_stops_early_on_a_slow_function_but_keeps_min_repeats():
    import time

    t = measure(lambda: time.sleep(0.01), [torch.device("cpu")], repeats=50, min_sample_s=0, max_total_s=0.0, min_repeats=3)
    assert t.repeats == 3
    assert t.inner == 1


def test_summarize_quartiles():
    t = summarize([1.0, 2.0, 3.0, 4.0, 5.0], inner=1, clock="cpu")
    assert t.median_s == 3.0
    assert t.iqr_s == pytest.approx(2.0)  # inclusive quartiles: 2 and 4
    assert (t.min_s, t.max_s) == (1.0, 5.0)
    single = summarize([2.0], inner=3, clock="cpu")
    assert single.iqr_s == 0 and single.median_s == 2.0


def test_clock_choice():
    cpu, g0, g1 = torch.device("cpu"), torch.device("cuda:0"), torch.device("cuda:1")
    assert pick_clock([cpu]) == "cpu"
    assert pick_clock([g0]) == "cuda-events"
    assert pick_clock([g0, g1]) == "wall+sync"
    assert pick_clock([g0, cpu]) == "wall+sync"
    assert pick_clock([g0], "wall+sync") == "wall+sync"


def test_check_close_passes_and_records():
    a = torch.tensor([1.0, 2.0, 3.0])
    check = check_close("same", a, a + 1e-9, rtol=1e-6, atol=0)
    assert check.passed and check.max_abs_diff < 1e-6
    assert check_close("lists", [a, a], [a.clone(), a.clone()], rtol=0, atol=0).tolerance == "exact"


@pytest.mark.parametrize(
    "actual, expected",
    [
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.1])),  # values differ
        (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0, 3.0])),  # shapes differ
        (torch.tensor([True, False]), torch.tensor([True, True])),  # masks must be identical
        (torch.tensor([float("nan")]), torch.tensor([float("nan")])),  # NaN never counts as equal
        ([torch.ones(2)], [torch.ones(2), torch.ones(2)]),  # different number of results
    ],
)
def test_check_close_raises_on_mismatch(actual, expected):
    with pytest.raises(ResultMismatch):
        check_close("differ", actual, expected, rtol=1e-6, atol=1e-6)
