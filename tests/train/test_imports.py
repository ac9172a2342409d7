"""What a one-device `gpulab train` imports beyond what torch itself imports for a training step:
every module is start-up time a user waits for, and on a read-only install each one is compiled
in every process. Allowed: rich (what it prints), psutil (the host's facts), matplotlib
(curves.png) and what they import, and gpulab's own modules of training - pinned below, so that a
new import is a decision; never the profiler's recorder or sampler, the planner, the benchmarks,
NVML or onnx."""

from __future__ import annotations

import json
import os
import subprocess
import sys

DUMP = """
import atexit, json, sys
out = sys.argv.pop(1)
atexit.register(lambda: open(out, "w").write(json.dumps(sorted(sys.modules))))
"""

TRAIN = DUMP + """
import runpy
sys.argv = ["gpulab", *sys.argv[1:]]
runpy.run_module("gpulab", run_name="__main__")
"""

# What a plain PyTorch training step imports (torch.optim's step pulls in much of torch), and
# what the libraries gpulab uses import themselves.
PLAIN = DUMP + """
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
torch.nn.functional.cross_entropy(model(torch.ones(3, 4)), torch.zeros(3, dtype=torch.long)).backward()
opt.step()
import matplotlib.figure, psutil, rich.console, rich.progress, rich.table
"""

# The gpulab modules a one-device run imports: the command line's parsers, training, data, the
# strategies (parallel/), and the light front doors of the other commands' options.
PINNED = {
    "gpulab", "gpulab.bench", "gpulab.bench.cli", "gpulab.bytecode", "gpulab.cli", "gpulab.compiler",
    "gpulab.config", "gpulab.data", "gpulab.data.decoded", "gpulab.data.fashion_mnist", "gpulab.data.idx",
    "gpulab.data.loader", "gpulab.data.sampling", "gpulab.data.user", "gpulab.devices", "gpulab.errors",
    "gpulab.hardware", "gpulab.hardware.cli", "gpulab.host", "gpulab.io", "gpulab.memory",
    "gpulab.memory.categories", "gpulab.memory.peak", "gpulab.models", "gpulab.models.layers", "gpulab.models.lenet",
    "gpulab.models.resnet", "gpulab.monitor", "gpulab.monitor.cli", "gpulab.monitor.config", "gpulab.options",
    "gpulab.parallel", "gpulab.parallel.allreduce", "gpulab.parallel.data_parallel", "gpulab.parallel.distributed",
    "gpulab.parallel.failures", "gpulab.parallel.graphed", "gpulab.parallel.launch", "gpulab.parallel.ranks",
    "gpulab.parallel.shard_files", "gpulab.parallel.sharded", "gpulab.parallel.strategy", "gpulab.parallel.sync_bn",
    "gpulab.parallel.world", "gpulab.plan", "gpulab.plan.cli", "gpulab.train", "gpulab.train.build",
    "gpulab.train.background", "gpulab.train.curves", "gpulab.train.display", "gpulab.train.loop", "gpulab.train.precision",
    "gpulab.train.recipe", "gpulab.train.resume", "gpulab.train.rundir", "gpulab.train.step",
}


def imported(script: str, args: list[str], tmp_path, name: str) -> set[str]:
    out = tmp_path / f"{name}.json"
    subprocess.run([sys.executable, "-c", script, str(out), *args], check=True, capture_output=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    return set(json.loads(out.read_text()))


def test_a_one_device_run_imports_only_what_it_uses(tiny_data, tmp_path):
    plain = imported(PLAIN, [], tmp_path, "plain")
    train = imported(TRAIN, ["train", "--devices", "cpu", "--epochs", "1", "--out", str(tmp_path / "run")], tmp_path,
                     "train")
    assert (tmp_path / "run" / "curves.png").is_file()  # the run did run, to its end
    packages = {m.split(".")[0] for m in train} - {m.split(".")[0] for m in plain}
    assert packages == {"gpulab"}, f"packages neither torch nor gpulab's libraries import: {sorted(packages - {'gpulab'})}"
    # torch.save's own (the checkpoint): the only torch modules a plain step has not imported
    assert {m for m in train - plain if m.split(".")[0] == "torch"} <= {"torch.utils.serialization",
                                                                       "torch.utils.serialization.config"}
    ours = {m for m in train if m.split(".")[0] == "gpulab"}
    assert ours == PINNED, f"new: {sorted(ours - PINNED)}; no longer: {sorted(PINNED - ours)}"
