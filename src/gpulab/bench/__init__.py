"""`gpulab bench`: the classic GPU lessons as measurements you can repeat on your own machine.

One module per benchmark; each has the same four parts, top to bottom:

    LESSON   one sentence: the claim the benchmark measures
    Config   a dataclass of sizes (its defaults: the 'full' run, for reports)
    PRESETS  the other sizes by name: 'quick' (CI, smoke tests: all nine took 121 s on a quiet
             2-core CPU, 109 s of it the training demo's whole processes) and 'tiny' (the test suite)
    run()    check that the compared ways compute the same result, then time them with the
             shared harness (`harness.measure`), filling a `result.Result`
    plot()   a matplotlib figure of the result

`runner.run_benchmark` ties them together and writes DIR/<name>.json and DIR/<name>.png.
"""

from __future__ import annotations

import importlib
from dataclasses import fields, replace
from types import ModuleType

from gpulab.errors import UserError

# name -> what it measures. Module names are the CLI names with '-' -> '_'; the order is the
# order of `bench all`.
BENCHMARKS = {
    "matmul": "square matmul n=16..8192 on CPU and GPUs (fp32/tf32/bf16): time, GFLOP/s, crossover",
    "sync-logging": "1000 small matmuls logging a norm: host read per step vs log on device",
    "concurrency": "two matmul workloads at once on two devices (or streams) vs one after another",
    "transfer": "host<->device bandwidth: pageable vs pinned, blocking vs non_blocking; copy vs place",
    "allreduce": "naive / ring / bucketed / NCCL / gloo x message size x k: time, algbw, busbw",
    "scaling": "data-parallel samples/s for k = 1..n devices, LeNet and ResNet-18: efficiency",
    "input-pipeline": "DataLoader (workers, pin_memory) vs device-resident loader: samples/s, device wait",
    "vectorize": "loops vs indexing: one-hot masks, padded masked loss, contiguous after permute",
    "training": "the 10-epoch demo vs the textbook's LeNet chapter, whole process: first and second run, time to 0.90",
}
PRESETS = ("full", "quick", "tiny")


def load(name: str) -> ModuleType:
    if name not in BENCHMARKS:
        raise UserError(f"unknown benchmark '{name}': choose all or one of {', '.join(BENCHMARKS)}")
    return importlib.import_module(f"gpulab.bench.{name.replace('-', '_')}")


def config(module: ModuleType, preset: str, rounds: int | None = None):
    """A benchmark's Config at the sizes of `preset`; `rounds`, where given, replaces the preset's
    for a benchmark that repeats whole runs in rounds (`repeats_rounds`)."""
    if preset not in PRESETS:
        raise UserError(f"unknown preset '{preset}': choose one of {', '.join(PRESETS)}")
    cfg = module.Config(**module.PRESETS[preset])
    return replace(cfg, rounds=rounds) if rounds is not None and repeats_rounds(module) else cfg


def repeats_rounds(module: ModuleType) -> bool:
    """Does the benchmark run its contenders in rounds (Config.rounds), so that --rounds applies?"""
    return "rounds" in {f.name for f in fields(module.Config)}


def expand(names: list[str]) -> list[str]:
    """CLI names -> benchmark names in suite order, 'all' expanded, duplicates dropped."""
    wanted: list[str] = []
    for name in names:
        for n in BENCHMARKS if name == "all" else [name]:
            load(n)  # validates the name
            if n not in wanted:
                wanted.append(n)
    return wanted
