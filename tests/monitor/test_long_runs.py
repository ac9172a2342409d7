"""A long run in bounded memory (issue 27): steps after the detailed window are summed into
blocks (record/blocks.py), the reader merges blocks down to a fixed number (events.py), and the
report counts every step, reads the later ones' step time from the blocks' histograms, and still
finds a stall among them."""

from __future__ import annotations

import json
import random
import statistics
import sys

from gpulab.cli import main
from gpulab.monitor.events import MAX_BLOCKS, Recording
from gpulab.monitor.record.blocks import BLOCK_STEPS, StepBlocks
from gpulab.monitor.analyze.step_costs import aggregate_summary
from tests.monitor.reports import read_report


def synthetic_steps(n: int, seed: int = 0) -> list[dict]:
    rng, t, steps = random.Random(seed), 0.0, []
    for i in range(n):
        seconds = rng.lognormvariate(-7, 0.3)  # ~1 ms, spread
        steps.append({"type": "step", "i": i, "t0": t, "t1": t + seconds, "profiled": False, "data": [],
                      "excl": {"compute": 0.7 * seconds, "other": 0.3 * seconds}, "counts": {"sync": 1}})
        t += seconds + 1e-4
    return steps


def written(steps: list[dict], detail_steps: int) -> list[dict]:
    """What the writer puts out for these steps, and at the end."""
    blocks = StepBlocks(detail_steps)
    return [record for s in steps for record in blocks.out(s)] + blocks.close()


def test_steps_after_the_window_are_summed_exactly():
    steps = synthetic_steps(5000)
    steps[3210]["t1"] += 2.0  # a long one after the window
    rec = Recording(written(steps, detail_steps=100))
    assert len(rec.steps) == 100 and rec.steps_done == 5000
    later = steps[100:]
    assert sum(b["n"] for b in rec.blocks) == len(later)
    assert abs(sum(b["excl"]["compute"] for b in rec.blocks) - sum(s["excl"]["compute"] for s in later)) < 1e-9
    assert sum(b["counts"]["sync"] for b in rec.blocks) == len(later)
    assert max(b["longest"]["i"] for b in rec.blocks if b["longest"]["t1"] - b["longest"]["t0"] > 1) == 3210
    summary = aggregate_summary(rec)
    true_median = statistics.median(s["t1"] - s["t0"] for s in later)
    assert abs(summary["median_step_s"] / true_median - 1) < 0.05, (summary, true_median)
    assert summary["steps"] == len(later) and summary["from_step"] == 100
    assert abs(summary["phases"]["compute"] - 0.7) < 0.01


def test_the_reader_merges_blocks_to_a_fixed_number_keeping_the_totals():
    n = (3 * MAX_BLOCKS + 7) * BLOCK_STEPS
    steps = synthetic_steps(n // 50)
    blocks = []
    for k in range(3 * MAX_BLOCKS + 7):  # blocks as the writer makes them, cheaply: 50 steps' worth each
        part = steps[(k * 50) % len(steps):(k * 50) % len(steps) + 50] or steps[:50]
        b = StepBlocks(0)
        for s in part:
            b.add(s)
        (block,) = b.close()
        block["n"] = BLOCK_STEPS
        blocks.append(block)
    rec = Recording(blocks)
    assert len(rec.blocks) <= MAX_BLOCKS
    assert sum(b["n"] for b in rec.blocks) == sum(b["n"] for b in blocks)
    assert abs(sum(b["excl"]["compute"] for b in rec.blocks) - sum(b["excl"]["compute"] for b in blocks)) < 1e-6


STALL_AFTER_THE_WINDOW = """
import time, torch
torch.set_num_threads(1)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(8, 4), torch.randn(8, 1)
for step in range(25_000):
    loss = torch.nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    if step == 20_000:
        time.sleep(1.5)  # planted: a stall long after the detailed window
    optimizer.step()
"""


def test_a_long_run_counts_every_step_and_finds_a_stall_among_the_summed_ones(tmp_path):
    script = tmp_path / "long.py"
    script.write_text(STALL_AFTER_THE_WINDOW)
    assert main(["profile", "--out", str(tmp_path / "prof"), "--", sys.executable, str(script)]) == 0
    report = read_report(tmp_path / "prof")
    assert report["steps"] == 25_000
    assert report["later_steps"]["steps"] == 15_000 and report["later_steps"]["from_step"] == 10_000
    stall = next(f for f in report["findings"] if f["cause"] == "stall")
    assert "stood still for 1.5 s in step 20000" in stall["evidence"]
    trace = json.loads((tmp_path / "prof" / "trace.json").read_text())
    assert sum(e.get("cat") == "step" for e in trace["traceEvents"]) <= 10_001  # detail only, then blocks
