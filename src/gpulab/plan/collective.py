"""Measure what one allreduce costs between real ranks, and fit the ring model's alpha and beta.

`measure(k, sizes)` starts k processes (this module run as a script), joined by torch.distributed
on the given backend over TCP: on one machine over loopback, or, with `Host`s, each rank in its
own network namespace (`gpulab.plan.netns`) so the bytes cross a real, rate-limited link. Each
size is all-reduced in rounds that go through all the sizes, after a warm-up (a hiccup of this
shared machine then costs each size one sample, not one size all of its samples); rank 0 writes
the median times.

`fit(sizes, seconds, k)` fits T(S) = a + b*S, b from the large messages and a from the small
ones, then reads the ring model's per-step alpha and per-byte beta out of a and b for the k the
timings were taken at (see `gpulab.plan.links`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpulab.errors import UserError
from gpulab.plan.links import LinkCost

MIN_ROUNDS = 3
MAX_ROUNDS = 40
SECONDS_PER_SIZE = 1.0
"""Go on with rounds until this much time per size is spent (at least MIN_ROUNDS, at most MAX_ROUNDS)."""


@dataclass
class Host:
    """Where one rank runs: a command prefix (e.g. `ip netns exec NAME`) and its environment."""

    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    address: str = "127.0.0.1"


def fit(sizes: list[float], seconds: list[float], k: int, source: str) -> LinkCost:
    """alpha and beta of the ring model from allreduce timings of `sizes` bytes over k ranks, read
    as nccl-tests figures are read: the per-byte cost from the large messages, the latency from the
    small ones (the median of what is left of their time once their bytes are paid). Gradient
    buckets are large: a fit on relative error over all sizes let the 4 KiB messages set the slope,
    and priced a 25 MB bucket up to 30% low over a 1 Gbit/s test link. The slope is the median of
    the slopes through the larger half (Siegel's repeated median), so that one size that met a busy
    moment of this shared machine cannot set it: a least-squares line priced a 516 KB bucket at
    3.7 ms on loopback, where it takes about 1 ms."""
    if k < 2 or len(sizes) < 2 or len(sizes) != len(seconds):
        raise ValueError("fit needs timings of at least two sizes over k >= 2 ranks")
    pairs = sorted(zip(sizes, seconds))
    half = len(pairs) // 2
    large, small = pairs[min(half, len(pairs) - 2):], pairs[:max(half, 1)]
    b = max(0.0, repeated_median_slope(large))
    a = max(0.0, statistics.median(t - b * s for s, t in small))
    steps = 2 * (k - 1)
    return LinkCost(alpha_s=a / steps, beta_s_per_byte=b / (steps / k), source=source)


def repeated_median_slope(points: list[tuple[float, float]]) -> float:
    """For each point the median slope to the others, then the median of those: a line that up to
    half of the points, however wrong, cannot move."""
    return statistics.median(
        statistics.median((t2 - t1) / (s2 - s1) for s2, t2 in points if s2 != s1) for s1, t1 in points)


def default_sizes(largest: int) -> list[int]:
    """4 KiB, 8 KiB, 16 KiB, ... and `largest` bytes (a model's largest bucket) to end with: sizes
    a factor of 2 apart, so that the larger half, which sets the per-byte cost, has enough of them
    for a median to outvote one bad timing. A power of 2 within 1.5x of `largest` is left out:
    two sizes that close give a slope that is mostly noise."""
    sizes, s = [], 4096
    while s * 1.5 <= largest:
        sizes.append(s)
        s *= 2
    return sizes + [max(largest, 4096)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rendezvous(hosts: list[Host]) -> tuple[str, int]:
    """Where the first host's rank keeps the group's store: a free port on loopback; in a test
    host (a namespace made for the measurement, nothing else listening there) a random one, so
    that one closing does not hold up the next."""
    if hosts[0].address == "127.0.0.1":
        return hosts[0].address, free_port()
    return hosts[0].address, random.randint(20000, 29000)


def measure(k: int, sizes: list[int], backend: str = "gloo", hosts: list[Host] | None = None,
            timeout_s: float = 300.0) -> dict:
    """Median seconds of an allreduce of each size over k ranks: {'sizes', 'seconds', 'backend', 'k'}."""
    hosts = hosts or [Host() for _ in range(k)]
    address, port = rendezvous(hosts)
    with tempfile.TemporaryDirectory(prefix="gpulab-plan-") as tmp:
        out = Path(tmp) / "collective.json"
        spec = {"k": k, "sizes": sizes, "backend": backend, "addr": address, "port": port, "out": str(out)}
        procs = []
        for rank, host in enumerate(hosts):
            cmd = [*host.prefix, sys.executable, "-m", "gpulab.plan.collective", json.dumps({**spec, "rank": rank})]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": child_pythonpath(), **host.env}
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        failed = wait_all(procs, timeout_s)
        if failed:
            raise UserError(f"measuring allreduce over {k} ranks failed: {failed}")
        return json.loads(out.read_text())


def child_pythonpath() -> str:
    """The ranks import the same gpulab as this process (also when run from a checkout)."""
    here = str(Path(__file__).resolve().parents[2])
    return os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])])


# a measuring process's refusal, as its traceback's last line ends: the message is the news
_USER_ERROR = re.compile(r"^(\[rank\d+\]:\s*)?gpulab\.errors\.UserError:\s*")


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> str | None:
    """Wait for every process; on a failure or the deadline stop the rest. The first failure's last line."""
    deadline = time.monotonic() + timeout_s
    failure = None
    try:
        for p in procs:
            try:
                output, _ = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failure = failure or f"no result within {timeout_s:g} s"
                break
            if p.returncode != 0 and failure is None:
                lines = [line for line in output.strip().splitlines() if line.strip()]
                failure = _USER_ERROR.sub("", lines[-1]) if lines else f"exit code {p.returncode}"
                break
    finally:  # also when gpulab is stopped (Terminated, Ctrl-C): no measuring process outlives it
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return failure


def _rank_main(spec: dict) -> None:
    """One rank: join the group, time each size, rank 0 writes the medians."""
    import datetime

    import torch
    import torch.distributed as dist

    from gpulab.io import atomic_write_json

    torch.set_num_threads(1)
    rank, k = spec["rank"], spec["k"]
    store = dist.TCPStore(spec["addr"], spec["port"], k, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=k,
                            timeout=datetime.timedelta(seconds=120))
    device = torch.device("cuda", rank % torch.cuda.device_count()) if spec["backend"] == "nccl" else torch.device("cpu")
    tensors = [torch.zeros(max(1, nbytes // 4), device=device) for nbytes in spec["sizes"]]
    for _ in range(2):  # warm-up: connections, buffers, TCP windows
        for t in tensors:
            dist.all_reduce(t)
    times: list[list[float]] = [[] for _ in tensors]
    rounds = 0
    while True:
        for t, timed in zip(tensors, times):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timed.append(time.perf_counter() - t0)
        rounds += 1
        spent = sum(map(sum, times))
        # Every rank must make the same number of calls: rank 0 decides whether to go on.
        more = torch.tensor([rounds < MIN_ROUNDS or (spent < SECONDS_PER_SIZE * len(tensors) and rounds < MAX_ROUNDS)],
                            device=device)
        dist.broadcast(more, src=0)
        if not more.item():
            break
    medians = [statistics.median(timed) for timed in times]
    if rank == 0:
        atomic_write_json(Path(spec["out"]), {"k": k, "backend": spec["backend"], "sizes": spec["sizes"], "seconds": medians})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
