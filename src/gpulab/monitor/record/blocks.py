"""Steps in aggregate, so that a recording of any length stays small.

The first `detail_steps` steps are written one record each: the window every per-step rule
judges. After it, steps are summed into blocks of at least BLOCK_STEPS steps and BLOCK_S seconds:
what each category took, the counts, a histogram of step times (bins 2^(1/8) apart: a median read
from it is within 5%) and the block's longest step whole (a stall is found there). The reader
merges them down to a fixed number (events.py). Runs on the writer's helper thread (or at emit,
in memory), not the training thread.
"""

from __future__ import annotations

import math

from gpulab.monitor.events import BINS_PER_OCTAVE, BlockRecord, StepRecord

BLOCK_STEPS = 1000
BLOCK_S = 1.0


def duration_bin(seconds: float) -> int:
    return math.floor(math.log2(max(seconds, 1e-9)) * BINS_PER_OCTAVE)


class StepBlocks:
    def __init__(self, detail_steps: int):
        self.detail_steps = detail_steps
        self._block: BlockRecord | None = None

    def out(self, record: dict) -> list[dict]:
        """What goes out for `record`: itself, or (a step after the detailed window) its block, once complete."""
        if record.get("type") != "step" or record["i"] < self.detail_steps:
            return [record]
        block = self.add(record)
        return [block] if block else []

    def add(self, step: StepRecord) -> BlockRecord | None:
        """Sum a step into the open block; the block, when this step completes it."""
        block = self._block
        if block is None:
            block = self._block = {"type": "block", "i0": step["i"], "i1": step["i"], "n": 0, "t0": step["t0"],
                                   "t1": step["t1"], "excl": {}, "counts": {}, "profiled": 0, "durations": {},
                                   "longest": None}
        block["i1"], block["t1"] = step["i"], step["t1"]
        block["n"] += 1
        block["profiled"] += bool(step.get("profiled"))
        for k, v in step["excl"].items():
            block["excl"][k] = block["excl"].get(k, 0.0) + v
        for k, v in step["counts"].items():
            block["counts"][k] = block["counts"].get(k, 0) + v
        seconds = step["t1"] - step["t0"]
        key = str(duration_bin(seconds))
        block["durations"][key] = block["durations"].get(key, 0) + 1
        longest = block["longest"]
        if longest is None or seconds > longest["t1"] - longest["t0"]:
            block["longest"] = {"i": step["i"], "t0": step["t0"], "t1": step["t1"], "excl": dict(step["excl"]),
                                "counts": dict(step["counts"])}
        if block["n"] >= BLOCK_STEPS and block["t1"] - block["t0"] >= BLOCK_S:
            self._block = None
            return block
        return None

    def close(self) -> list[BlockRecord]:
        """The open block, ended now (at the end of the recording), if there is one."""
        block, self._block = self._block, None
        return [block] if block else []
