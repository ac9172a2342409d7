"""Measure one training step on one device: how long it takes, and when during backward each
gradient bucket becomes ready to send.

This is the side that runs and reads: `measure()` starts the child that measures
(`python -m gpulab.plan.profile_step SPEC`, gpulab train's own step with hooks on it; see that
module), one process per copy, waits for them, and reads the `StepProfile` each wrote
(`gpulab.plan.profile`). It imports no torch (a test checks it): the measurement is the
child's, in its own process, so that its thread count is the one a rank would get; `copies` > 1
runs that many at once, as k ranks share one machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from gpulab.errors import UserError
from gpulab.plan.collective import Host, child_pythonpath, rendezvous, wait_all
from gpulab.plan.profile import StepProfile

CHILD = "gpulab.plan.profile_step"
"""The module each copy runs (`python -m`): it alone imports torch and gpulab train."""


def measure(cfg: dict, batch: int, threads: int, seconds: float = 3.0, warmup: int = 3, copies: int = 1,
            hosts: list[Host] | None = None, timeout_s: float = 900.0) -> StepProfile:
    """Profile gpulab train's step (config fields in `cfg`) at `batch` samples per device: steps
    for about `seconds` after `warmup` steps (this machine's speed drifts by +-10% from one second
    to the next; a few seconds of steps average that out). Copy i runs on `hosts[i]` when given
    (test hosts: their handshakes and gradient exchange cross the link between them)."""
    hosts = hosts or [Host() for _ in range(copies)]
    address, port = rendezvous(hosts)
    with tempfile.TemporaryDirectory(prefix="gpulab-plan-") as tmp:
        procs, outs = [], []
        for i, host in enumerate(hosts[:copies]):
            out = Path(tmp) / f"step-{i}.json"
            spec = {"cfg": cfg, "batch": batch, "threads": threads, "seconds": seconds, "warmup": warmup, "out": str(out),
                    "copy": i, "copies": copies, "address": address, "port": port}
            procs.append(subprocess.Popen([*host.prefix, sys.executable, "-m", CHILD, json.dumps(spec)],
                                          env=_child_env(host, threads, copies),
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs.append(out)
        failed = wait_all(procs, timeout_s)
        if failed:
            raise UserError(f"profiling one step at batch {batch} failed: {failed}")
        profiles = [StepProfile(**json.loads(o.read_text())) for o in outs]
    return max(profiles, key=lambda p: p.step_s)  # in step with each other: the same pace; take the slowest


def _child_env(host: Host, threads: int, copies: int) -> dict[str, str]:
    """A copy's environment: this gpulab on its path, its host's settings, and with copies its
    share of the cores."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(), **host.env}
    if copies > 1:  # as gpulab launch sets it for its ranks; one process is left as gpulab train is
        env["OMP_NUM_THREADS"] = str(threads)
    return env
