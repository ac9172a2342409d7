"""Measure one training step on one device: how long it takes, and when during backward each
gradient bucket becomes ready to send.

The step is gpulab train's own (`build` + `strategy.train_step` + the data loader) on one device
with the per-device batch; the buckets are the ones `GradSync` would send (`Buckets`: same
layout, same sizes). Timestamps, all on the device's clock:

    step start -> forward ends (a forward hook) -> each bucket's last gradient lands (the
    buckets' ready listener) -> the optimizer has stepped (step end)

`StepProfile` (`gpulab.plan.profile`) keeps the mean step time (throughput is total time over
steps) and every step's time, and the medians of the time before backward (data, forward), of
each bucket's ready time counted from the start of backward, backward's length (the last
bucket), and the time after it (optimizer). The profile runs in its own process, so that its
thread count is the one a rank would get; `copies` > 1 runs that many at once, as k ranks share
one machine.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from gpulab.errors import UserError
from gpulab.plan.collective import Host, child_pythonpath, rendezvous, wait_all
from gpulab.plan.predict import fit_overlap
from gpulab.plan.profile import StepProfile


WARMUP_S = 1.0
MIN_STEPS = 5
MAX_STEPS = 400


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
            env = {**os.environ, "PYTHONPATH": child_pythonpath(), **host.env}
            if copies > 1:  # as gpulab launch sets it for its ranks; one process is left as gpulab train is
                env["OMP_NUM_THREADS"] = str(threads)
            procs.append(subprocess.Popen([*host.prefix, sys.executable, "-m", "gpulab.plan.step", json.dumps(spec)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            outs.append(out)
        failed = wait_all(procs, timeout_s)
        if failed:
            raise UserError(f"profiling one step at batch {batch} failed: {failed}")
        profiles = [StepProfile(**json.loads(o.read_text())) for o in outs]
    return max(profiles, key=lambda p: p.step_s)  # in step with each other: the same pace; take the slowest


class _Clock:
    """Timestamps on the device's timeline: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device):
        import torch

        self.cuda = device.type == "cuda"
        self.torch = torch

    def now(self):
        if self.cuda:
            e = self.torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def settle(self) -> None:
        """Before reading a step's timestamps: its events have happened (once per step)."""
        if self.cuda:
            self.torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _profile_main(spec: dict) -> None:
    import torch

    from gpulab.io import atomic_write_json
    from gpulab.parallel.meter import Meter
    from gpulab.parallel.phases import add_phase_listener
    from gpulab.parallel.world import World
    from gpulab.config import TrainConfig
    from gpulab.train.build import build

    torch.set_num_threads(spec["threads"])
    in_step = _join_copies(spec) if spec["copies"] > 1 else (lambda done: done)
    # One device's compute is the same replicated or sharded (FSDP's gathers are predicted from
    # the units' sizes): the profile is of the replicated step, in one process - in the layout a
    # sharded run uses (NCHW: FSDP2 shards contiguous parameters only).
    sharded = spec["cfg"].get("shard") == "fsdp"
    layout = {"channels_last": "off"} if sharded and spec["cfg"].get("channels_last") in (None, "auto") else {}
    cfg = TrainConfig.from_dict({**spec["cfg"], "batch_size": spec["batch"], "epochs": 1, "out": None, "profile": False,
                                 "shard": "none", **layout})
    run = build(cfg, World())
    strategy = run.strategy
    model, buckets, device = strategy.replicas[0], strategy.buckets, strategy.devices[0]
    clock = _Clock(device)
    marks: dict = {}
    model.register_forward_hook(lambda *_: marks.__setitem__("forward_end", clock.now()))
    # Each bucket's ready time, from its Buckets (this listener first: before any launch below).
    buckets.add_ready_listener(lambda _replica, b: marks.setdefault("buckets", {}).__setitem__(b, clock.now()))
    exchange = _Exchange(buckets)
    remove_listener = add_phase_listener(exchange.in_phase)

    def batches():
        epoch = 0
        while True:
            run.train_loader.set_epoch(epoch)
            yield from run.train_loader
            epoch += 1

    source = batches()
    meter = Meter(device)

    def summed_to_mean(out, y):
        # As a run does (each rank's loss weighted by its share of the global batch): the summed
        # gradients are the mean, so the copies go on training alike, at no cost in the step.
        return run.loss_fn(out, y) / spec["copies"]

    def one_step(enough: bool = False, exchanged: bool = False, note_batch=None):
        """(step seconds, seconds before backward, each bucket's ready time), and whether every
        copy has timed enough. `exchanged`: the copies exchange their gradients in this step;
        `note_batch(batch)`: told the step's batch (the memory probe)."""
        marks.clear()
        start = clock.now()
        X, y = next(source)
        if note_batch is not None:
            note_batch((X, y))
        strategy.set_lr(run.peak_lr)
        exchange.begin_step(exchanged)
        strategy.train_step(X, y, summed_to_mean if exchanged else run.loss_fn, meter)
        all_done = in_step(enough)
        end = clock.now()
        clock.settle()
        forward_end = marks["forward_end"]
        ready = [clock.seconds(forward_end, marks["buckets"][b]) for b in range(buckets.num_buckets)]
        return (clock.seconds(start, end), clock.seconds(start, forward_end), ready), all_done

    # Warm up for `warmup` steps and WARMUP_S seconds, whichever is longer: a fresh process's first
    # second (allocator, oneDNN's kernels, the first connections of a test host) is slower than
    # the rest, and three of LeNet's 25 ms steps do not cover it. The copies agree when to stop.
    warm_from, warm_steps = time.perf_counter(), 0
    while True:
        warm_steps += 1
        _, all_warm = one_step(warm_steps >= spec["warmup"] and time.perf_counter() - warm_from >= WARMUP_S)
        if all_warm:
            break
    rows = []
    timed_from = time.perf_counter()
    while len(rows) < MAX_STEPS:
        # Timed long enough once this step is counted? The end-of-step handshake tells whether
        # every copy is (copies in step must stop together, or one would wait for the other).
        enough = len(rows) + 1 >= MIN_STEPS and time.perf_counter() - timed_from >= spec["seconds"]
        row, all_done = one_step(enough)
        rows.append(row)
        if all_done:
            break
    median = statistics.median
    step_s = statistics.fmean(r[0] for r in rows)  # throughput is total time over steps: the mean
    before = median(r[1] for r in rows)
    ready = [median(r[2][b] for r in rows) for b in range(buckets.num_buckets)]
    backward = max(ready)
    profile = StepProfile(
        batch=spec["batch"], step_s=step_s, before_backward_s=before, backward_s=backward,
        after_backward_s=max(0.0, step_s - before - backward),
        bucket_bytes=[flat.numel() * flat.element_size() for flat in buckets.buffers[0]],
        bucket_ready_s=ready, device=str(device), threads=torch.get_num_threads(),
        step_times_s=[r[0] for r in rows], copies=spec["copies"], unit_bytes=unit_bytes(model),
    )
    profile.memory = _measure_memory(one_step, strategy, device)
    if spec["copies"] > 1:
        profile.overlap = _measure_overlap(one_step, exchange, profile)
    remove_listener()
    if spec["copies"] > 1 and sharded:
        profile.sharded_step_s, profile.sharded_peak = _measure_sharded_step(spec, run, source, in_step)
    atomic_write_json(Path(spec["out"]), profile.to_dict())


class _Exchange:
    """The copies' gradient exchange, on only in the steps that measure the overlap: a `GradSync`
    on the strategy's own buckets, as a rank of a real run has, so each bucket's allreduce starts
    during backward in bucket order, and it is waited for where a run waits: as the step enters
    its "allreduce" phase, between backward and the optimizer (a phase listener)."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.grad_sync = None  # made by connect()

    def connect(self, group) -> None:
        from gpulab.parallel.distributed import GradSync

        self.grad_sync = GradSync(self.buckets, group)

    def begin_step(self, on: bool) -> None:
        """Before a step's backward (the profile's steps are one micro-batch each)."""
        if self.grad_sync is not None:
            self.grad_sync.begin_backward(communicate=on)

    @contextmanager
    def in_phase(self, name: str):
        if name == "allreduce" and self.grad_sync is not None and self.grad_sync.communicate:
            self.grad_sync.finish()
        yield


def _measure_sharded_step(spec: dict, run, source, in_step) -> tuple[float, int]:
    """The copies' step with --shard fsdp (torch's FSDP2 over their gloo group, a fresh copy of the
    model): what FSDP itself costs here - its gathers and reduce-scatters on this link, its
    copies in and out of gathered buffers, its hooks - which the model of predict.py does not
    price. Timed as the replicated step is: warm-up, then about `seconds` of steps; then one
    step's peak memory (gpulab.memory.step), FSDP's buffers included. (step seconds, peak bytes)"""
    import copy

    from gpulab.parallel.sharded import Sharded  # torch: the child's, as every import of it here
    from gpulab.train.precision import autocast_dtype
    from gpulab.train.recipe import make_optimizer

    replica = run.strategy.replicas[0]
    model = copy.deepcopy(replica)
    _release(run.strategy)  # its whole state would count in the sharded step's memory
    world = _CopiesWorld(spec["copy"], spec["copies"])
    strategy = Sharded(model, world, run.strategy.devices[0], spec["batch"] * spec["copies"],
                       make_optimizer(run.cfg.recipe_spec, run.peak_lr), autocast=autocast_dtype(run.cfg, run.devices))
    loss_fn = lambda out, y: run.loss_fn(out, y) / spec["copies"]  # noqa: E731 (each copy its share, as a rank)

    def step(enough: bool = False, note_batch=None) -> tuple[float, bool]:
        start = time.perf_counter()
        X, y = next(source)
        if note_batch is not None:
            note_batch((X, y))
        strategy.train_step(X, y, loss_fn)
        return time.perf_counter() - start, in_step(enough)

    warm_from, warm_steps = time.perf_counter(), 0
    while True:
        warm_steps += 1
        if step(warm_steps >= spec["warmup"] and time.perf_counter() - warm_from >= WARMUP_S)[1]:
            break
    times, timed_from = [], time.perf_counter()
    while len(times) < MAX_STEPS:
        seconds, all_done = step(len(times) + 1 >= MIN_STEPS and time.perf_counter() - timed_from >= spec["seconds"])
        times.append(seconds)
        if all_done:
            break
    from gpulab.memory.step import measure_step  # torch: the child's, as every import of it here

    peak = measure_step(step, strategy.devices[0], strategy.replicas, [strategy.optimizer])["peak"]
    return statistics.fmean(times), peak


def _release(strategy) -> None:
    """Free a replicated strategy's parameters, gradients (its buckets) and optimizer state: the
    profile is done with it."""
    for optimizer in strategy.optimizers:
        optimizer.state.clear()
    for replica in strategy.replicas:
        for p in replica.parameters():
            p.grad = None
        replica.to("meta")
    for flats in strategy.buckets.buffers:
        flats.clear()


class _CopiesWorld:
    """The copies' gloo group as gpulab's World (what Sharded needs of one): rank, size, group."""

    def __init__(self, rank: int, size: int):
        import torch.distributed as dist

        self.rank, self.world_size, self.backend = rank, size, "gloo"
        self.group = dist.group.WORLD

    @contextmanager
    def collectives(self):
        yield


def _measure_memory(one_step, strategy, device) -> dict:
    """One step's memory (gpulab.memory.step): the probe starts in one step and measures the
    next (copies in step take both steps together, as they take every step)."""
    from gpulab.memory.step import measure_step  # torch: the child's, as every import of it here

    measured = measure_step(one_step, device, strategy.replicas, strategy.optimizers)
    return {**{k: measured[k] for k in ("peak", "at_peak", "sizes", "batch")},
            "largest_unit": largest_unit_bytes(strategy.replicas[0])}


def unit_bytes(model) -> list[int]:
    """The parameter bytes of each unit --shard fsdp would wrap, then what the root holds itself."""
    from gpulab.parallel.sharded import shard_units  # torch: the child's, as every import of it here

    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    units = [nbytes(u) for u in shard_units(model)]
    return units + [nbytes(model) - sum(units)]


def largest_unit_bytes(model) -> int:
    """The parameters of the largest part of the model that sharding would gather at once: the
    largest module holding at most half of the model's parameters (a layer of LeNet, a residual
    block of ResNet-18), or the whole model when no part is that small."""
    def nbytes(module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    total = nbytes(model)
    parts = [nbytes(m) for m in model.modules() if m is not model and 0 < nbytes(m) <= total / 2]
    return max(parts, default=total)


OVERLAP_MIN_PAIRS = 6
OVERLAP_MAX_PAIRS = 100
OVERLAP_SECONDS = 2.0


def _measure_overlap(one_step, exchange: _Exchange, profile: StepProfile) -> float:
    """How fast an allreduce progresses during backward, as a share of its idle speed, measured
    with the copies' own gradient buckets exchanged as a run exchanges them: pairs of steps
    without and with the exchange (alternated, so that drift hits both alike) give what it adds
    to the step; each bucket's allreduce timed on idle copies gives what it costs; the share is
    the one at which the model's schedule (`predict.fit_overlap`) adds as much. It includes what
    the exchange costs the computation (on a CPU, gloo and the network stack share its cores)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")  # apart from the handshakes' group
    exchange.connect(group)

    def idle_allreduce_s(flat) -> float:
        copy, times = flat.clone(), []
        for _ in range(3):
            start = time.perf_counter()
            dist.all_reduce(copy, group=group)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    idle_s = [idle_allreduce_s(flat) for flat in exchange.buckets.buffers[0]]
    added, started = [], time.perf_counter()
    while True:
        (plain, *_), _ = one_step()
        # Copies stop together: the exchanged step's handshake carries "timed enough", as in the profile.
        pairs = len(added) + 1
        enough = pairs >= OVERLAP_MAX_PAIRS or (pairs >= OVERLAP_MIN_PAIRS and time.perf_counter() - started >= OVERLAP_SECONDS)
        (exchanged, *_), all_done = one_step(enough, exchanged=True)
        added.append(exchanged - plain)
        if all_done:
            break
    # Every copy reports the same share: from the mean over copies of their median added time.
    mean_added = torch.tensor([statistics.median(added)], dtype=torch.float64)
    dist.all_reduce(mean_added)
    return fit_overlap(profile.bucket_ready_s, idle_s, profile.backward_s, mean_added.item() / dist.get_world_size())


def _join_copies(spec: dict):
    """Copies that run at once join one gloo group; returns the end-of-step handshake: a 4-byte
    allreduce (every copy waits for the slowest, as ranks do) of "I have timed enough", whose
    minimum says whether all have."""
    import datetime

    import torch
    import torch.distributed as dist

    store = dist.TCPStore(spec["address"], spec["port"], spec["copies"], spec["copy"] == 0,
                          timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=spec["copy"], world_size=spec["copies"],
                            timeout=datetime.timedelta(seconds=300))
    def handshake(done: bool) -> bool:
        flag = torch.tensor([1.0 if done else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    return handshake


if __name__ == "__main__":
    _profile_main(json.loads(sys.argv[1]))
