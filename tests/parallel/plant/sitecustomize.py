"""Planted in the ranks of tests/parallel/test_torchrun.py's jobs (this folder first on PYTHONPATH,
so Python runs it at start-up): with GPULAB_TEST_PAUSE=RANK:STEP:FILE, the torchrun rank RANK
stops after its STEP-th optimizer step of the run (1-based), writes FILE and sleeps there, inside
the epoch, until the test kills it. The kill then lands mid-epoch on data of any size, with no
timer to race (the tests used 4096-sample epochs long enough to kill a rank in: 10-80 s each).
Any other process, and every process without the variable, only reads the variable."""

import os

_PAUSE = os.environ.get("GPULAB_TEST_PAUSE", "")

if _PAUSE and os.environ.get("RANK") == _PAUSE.split(":", 2)[0]:
    import time
    from pathlib import Path

    from torch.optim.optimizer import register_optimizer_step_post_hook

    _AT_STEP, _FILE = int(_PAUSE.split(":", 2)[1]), Path(_PAUSE.split(":", 2)[2])
    _steps = 0

    def _pause(optimizer, args, kwargs) -> None:
        global _steps
        _steps += 1
        if _steps == _AT_STEP:
            _FILE.write_text(str(os.getpid()))
            while True:
                time.sleep(3600)

    register_optimizer_step_post_hook(_pause)
