"""Does gpulab train's step at a per-device batch fit a memory budget? Run it and see.

    python -m gpulab.plan.fits SPEC     (SPEC: JSON {cfg, batch, budget, out})

The child builds the run (data, model, optimizer) and measures one step at the full batch
(gpulab.memory.step): it fits when its peak stays within the budget. On CUDA the budget is also
enforced, by the caching allocator itself (torch.cuda.set_per_process_memory_fraction): a step
that needs more fails there with an out-of-memory error. A CPU has no such limit: its allocator
keeps no count, and limits on the process (RLIMIT_AS, a memory cgroup) count everything the
process maps or touches - libraries, oneDNN's scratch space, the allocator's own arenas - not
torch's tensors (measured here: RLIMIT_AS set to the tensors' budget fails LeNet's step at every
batch, oneDNN "could not create a primitive"), so there the measured peak is the answer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(spec: dict) -> None:
    import torch

    from gpulab.config import TrainConfig
    from gpulab.io import atomic_write_json
    from gpulab.memory.oom import is_out_of_memory
    from gpulab.memory.step import measure_step
    from gpulab.parallel.world import World
    from gpulab.train.build import build

    cfg = TrainConfig.from_dict({**spec["cfg"], "batch_size": spec["batch"], "epochs": 1, "out": None, "profile": False})
    run = build(cfg, World())
    device, strategy = run.strategy.devices[0], run.strategy
    X, y = next(iter(run.train_loader))
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget"] / total), device)
    result = {"batch": spec["batch"], "budget": spec["budget"], "peak": None, "fits": False, "error": None,
              "enforced": device.type == "cuda"}

    def one_step(note_batch=None):
        if note_batch is not None:
            note_batch((X, y))
        run.trainer.train_step(X, y)

    try:
        result["peak"] = measure_step(one_step, device, strategy.replicas, strategy.optimizers)["peak"]
        result["fits"] = result["peak"] <= spec["budget"]
    except (RuntimeError, MemoryError) as e:
        if not is_out_of_memory(e):
            raise
        result["error"] = str(e).splitlines()[0][:300]
    atomic_write_json(Path(spec["out"]), result)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
