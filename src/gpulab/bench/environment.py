"""What a benchmark ran on: enough to tell whether two result files are comparable."""

from __future__ import annotations

import datetime
import os
import platform

import torch

import gpulab
from gpulab.hardware.describe import describe
from gpulab.io import git_commit


def environment() -> dict:
    """Device names, driver/CUDA, torch, threads, date: recorded in every benchmark JSON."""
    report = describe()
    cpu = report["cpu"]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).astimezone().isoformat(timespec="seconds"),
        "gpulab": gpulab.__version__,
        "git_commit": git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_cuda_build": report["torch_cuda_build"],
        "cudnn": report["cudnn"],
        "driver": report["driver"],
        "gpus": [
            {"index": g["index"], "name": g["name"],
             "memory_total_mib": round(g["memory_total_mib"]) if g["memory_total_mib"] is not None else None}
            for g in report["gpus"]
        ],
        "torch_sees_gpus": report["torch_sees_gpus"],
        "cpu": {
            "model": cpu["model"],
            "logical_cores": cpu["logical_cores"],
            "physical_cores": cpu["physical_cores"],
            "memory_total_gib": round(cpu["memory_total_gib"], 1),
        },
        # The thread pools decide CPU numbers as much as the cores do.
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        # Other processes on a shared machine distort CPU numbers (a busy core stalls every
        # OpenMP barrier): the load average says whether the machine was quiet.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_busy_pct": cpu_busy_pct(),
    }


def cpu_busy_pct(interval_s: float = 0.3) -> float:
    """How busy the CPU is right now (before we start), in percent of all cores."""
    import psutil

    return psutil.cpu_percent(interval=interval_s)


def contention_warning(others_pct: float, when: str) -> str:
    """What other processes' CPU use does to the timings (one wording for before and during a run)."""
    return (f"other processes used {others_pct:.0f}% of the CPU {when}: CPU timings are inflated and noisy (a "
            "thread pool waits for its descheduled threads at every parallel region); rerun on a quiet machine "
            "for numbers to report")


class OtherLoad:
    """The share of the CPU that *other* processes used while a benchmark ran.

    System-wide busy CPU time minus this process's own (and its reaped children's): what is
    left is someone else's work competing for the same cores.
    """

    def __init__(self):
        self.start = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        import time

        import psutil

        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        me = psutil.Process().cpu_times()
        mine = me.user + me.system + me.children_user + me.children_system
        return time.perf_counter(), busy, mine

    def pct(self) -> float:
        import psutil

        wall0, busy0, mine0 = self.start
        wall1, busy1, mine1 = self._sample()
        capacity = (wall1 - wall0) * (psutil.cpu_count() or 1)
        return max(0.0, 100.0 * ((busy1 - busy0) - (mine1 - mine0)) / capacity) if capacity > 0 else 0.0
