"""The child that profiles one training step on one device: how long it takes, and when during
backward each gradient bucket becomes ready to send.

    python -m gpulab.plan.profile_step SPEC     (SPEC: JSON from gpulab.plan.step.measure)

`gpulab.plan.step` starts it (one process per copy) and reads the `StepProfile` it writes; this
side imports torch and gpulab train's modules, that side neither.

The step is gpulab train's own (`build` + `Trainer.train_step` + the data loader) on one device
with the per-device batch; the buckets are the ones `GradSync` would send (`Buckets`: same
layout, same sizes). Timestamps, all on the device's clock:

    step start -> forward ends (a forward hook) -> each bucket's last gradient lands (the
    buckets' ready listener) -> the optimizer has stepped (step end)

The profile keeps the mean step time (throughput is total time over steps) and every step's
time, and the medians of the time before backward (data, forward), of each bucket's ready time
counted from the start of backward, backward's length (the last bucket), and the time after it
(optimizer). Then one step's memory; and, when copies run at once (k ranks sharing one machine),
the overlap (what exchanging their buckets adds to the step) and, with --shard fsdp, their
sharded step.
"""

from __future__ import annotations

import copy
import datetime
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from gpulab.config import TrainConfig
from gpulab.io import atomic_write_json
from gpulab.memory.step import measure_step
from gpulab.parallel.distributed import GradSync
from gpulab.parallel.sharded import Sharded, shard_units
from gpulab.parallel.world import World
from gpulab.plan.predict import fit_overlap
from gpulab.plan.profile import StepProfile
from gpulab.train.build import build
from gpulab.train.precision import autocast_dtype
from gpulab.train.recipe import make_optimizer
from gpulab.train.step import Meter, Trainer, add_phase_listener

WARMUP_S = 1.0
MIN_STEPS = 5
MAX_STEPS = 400


def main(spec: dict) -> None:
    """Profile the step `spec` describes (config fields, batch, threads, seconds, warmup, this
    copy and how many run at once, where they meet) and write its StepProfile to spec["out"]."""
    torch.set_num_threads(spec["threads"])
    copies = spec["copies"]
    in_step = _join_copies(spec) if copies > 1 else (lambda done: done)
    sharded = spec["cfg"].get("shard") == "fsdp"
    run = build(_replicated_config(spec), World())
    source = _endless(run.train_loader)
    step = _TimedStep(run, source, in_step, copies)
    remove_listener = add_phase_listener(step.exchange.in_phase)
    _warm_up(step, spec)
    profile = _step_profile(spec, step, _time_steps(step, spec))
    profile.memory = _measure_memory(step, run.strategy, step.device)
    profile.train_samples = run.train_loader.batches.num_samples
    if copies > 1:
        profile.overlap = _measure_overlap(step, step.exchange, profile)
    remove_listener()
    if copies > 1 and sharded:
        profile.sharded_step_s, profile.sharded_peak = _measure_sharded_step(spec, run, source, in_step)
    atomic_write_json(Path(spec["out"]), profile.to_dict())


def _replicated_config(spec: dict) -> TrainConfig:
    """One device's compute is the same replicated or sharded (FSDP's gathers are predicted from
    the units' sizes): the profile is of the replicated step, in one process - in the layout a
    sharded run uses (NCHW: FSDP2 shards contiguous parameters only)."""
    sharded = spec["cfg"].get("shard") == "fsdp"
    layout = {"channels_last": "off"} if sharded and spec["cfg"].get("channels_last") in (None, "auto") else {}
    return TrainConfig.from_dict({**spec["cfg"], "batch_size": spec["batch"], "epochs": 1, "out": None,
                                  "profile": False, "shard": "none", **layout})


def _endless(loader):
    """The loader's batches, epoch after epoch: a profile takes as many steps as it needs."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


class _Clock:
    """Timestamps on the device's timeline: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def settle(self) -> None:
        """Before reading a step's timestamps: its events have happened (once per step)."""
        if self.cuda:
            torch.cuda.synchronize()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


class _TimedStep:
    """gpulab train's replicated step, timed: called as `step(enough, exchanged, note_batch)`, it
    takes one step and returns ((step seconds, seconds before backward, each bucket's ready time
    after forward's end), whether every copy has timed enough). `enough`: this copy has;
    `exchanged`: the copies exchange their gradients in this step; `note_batch(batch)`: told the
    step's batch (the memory probe)."""

    def __init__(self, run, source, in_step, copies: int):
        self.run, self.source, self.in_step, self.copies = run, source, in_step, copies
        self.strategy = strategy = run.strategy
        self.model, self.buckets, self.device = strategy.replicas[0], strategy.buckets, strategy.devices[0]
        self.clock = clock = _Clock(self.device)
        self.marks = marks = {}  # the hooks' timestamps of the step under way
        self.model.register_forward_hook(lambda *_: marks.__setitem__("forward_end", clock.now()))
        # Each bucket's ready time, from its Buckets (this listener first: before any launch below).
        self.buckets.add_ready_listener(lambda _replica, b: marks.setdefault("buckets", {}).__setitem__(b, clock.now()))
        self.exchange = _Exchange(self.buckets)
        self.meter = Meter(self.device)
        # The same step with the loss each copy takes when the copies exchange gradients.
        self.exchanging_trainer = copy.copy(run.trainer)
        self.exchanging_trainer.loss_fn = self._summed_to_mean

    def __call__(self, enough: bool = False, exchanged: bool = False, note_batch=None):
        marks, clock = self.marks, self.clock
        marks.clear()
        start = clock.now()
        X, y = next(self.source)
        if note_batch is not None:
            note_batch((X, y))
        self.run.trainer.set_lr(self.run.peak_lr)
        self.exchange.begin_step(exchanged)
        (self.exchanging_trainer if exchanged else self.run.trainer).train_step(X, y, self.meter)
        all_done = self.in_step(enough)
        end = clock.now()
        clock.settle()
        forward_end = marks["forward_end"]
        ready = [clock.seconds(forward_end, marks["buckets"][b]) for b in range(self.buckets.num_buckets)]
        return (clock.seconds(start, end), clock.seconds(start, forward_end), ready), all_done

    def _summed_to_mean(self, out, y):
        # As a run does (each rank's loss weighted by its share of the global batch): the summed
        # gradients are the mean, so the copies go on training alike, at no cost in the step.
        return self.run.loss_fn(out, y) / self.copies


def _warm_up(step, spec: dict) -> None:
    """Take `warmup` steps and WARMUP_S seconds, whichever is longer: a fresh process's first
    second (allocator, oneDNN's kernels, the first connections of a test host) is slower than
    the rest, and three of LeNet's 25 ms steps do not cover it. The copies agree when to stop."""
    warm_from, warm_steps = time.perf_counter(), 0
    while True:
        warm_steps += 1
        _, all_warm = step(warm_steps >= spec["warmup"] and time.perf_counter() - warm_from >= WARMUP_S)
        if all_warm:
            return


def _time_steps(step, spec: dict) -> list:
    """What `step` returns for each timed step: about `seconds` of them, at least MIN_STEPS, at
    most MAX_STEPS."""
    rows = []
    timed_from = time.perf_counter()
    while len(rows) < MAX_STEPS:
        # Timed long enough once this step is counted? The end-of-step handshake tells whether
        # every copy is (copies in step must stop together, or one would wait for the other).
        enough = len(rows) + 1 >= MIN_STEPS and time.perf_counter() - timed_from >= spec["seconds"]
        row, all_done = step(enough)
        rows.append(row)
        if all_done:
            break
    return rows


def _step_profile(spec: dict, step: _TimedStep, rows: list) -> StepProfile:
    """The timed steps summed up: the mean step, the medians of the rest."""
    median = statistics.median
    num_buckets = step.buckets.num_buckets
    step_s = statistics.fmean(r[0] for r in rows)  # throughput is total time over steps: the mean
    before = median(r[1] for r in rows)
    ready = [median(r[2][b] for r in rows) for b in range(num_buckets)]
    backward = max(ready)
    return StepProfile(
        batch=spec["batch"], step_s=step_s, before_backward_s=before, backward_s=backward,
        after_backward_s=max(0.0, step_s - before - backward),
        bucket_bytes=[flat.numel() * flat.element_size() for flat in step.buckets.buffers[0]],
        bucket_ready_s=ready, device=str(step.device), threads=torch.get_num_threads(),
        step_times_s=[r[0] for r in rows], copies=spec["copies"], unit_bytes=unit_bytes(step.model),
    )


class _Exchange:
    """The copies' gradient exchange, on only in the steps that measure the overlap: a `GradSync`
    on the strategy's own buckets, as a rank of a real run has, so each bucket's allreduce starts
    during backward in bucket order, and it is waited for where a run waits: as the step enters
    its "allreduce" phase, between backward and the optimizer (a phase listener)."""

    def __init__(self, buckets):
        self.buckets = buckets
        self.grad_sync = None  # made by connect()

    def connect(self, group) -> None:
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
    replica = run.strategy.replicas[0]
    model = copy.deepcopy(replica)
    _release(run.strategy)  # its whole state would count in the sharded step's memory
    world = _CopiesWorld(spec["copy"], spec["copies"])
    strategy = Sharded(model, world, run.strategy.devices[0], spec["batch"] * spec["copies"],
                       make_optimizer(run.cfg.recipe_spec, run.peak_lr), param_dtype=autocast_dtype(run.cfg, run.devices, run.compile))
    loss_fn = lambda out, y: run.loss_fn(out, y) / spec["copies"]  # noqa: E731 (each copy its share, as a rank)
    trainer = Trainer(strategy, loss_fn)  # FSDP's policy casts: no autocast

    def step(enough: bool = False, note_batch=None) -> tuple[float, bool]:
        start = time.perf_counter()
        X, y = next(source)
        if note_batch is not None:
            note_batch((X, y))
        trainer.train_step(X, y)
        return time.perf_counter() - start, in_step(enough)

    _warm_up(step, spec)
    times = _time_steps(step, spec)
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
        self.rank, self.world_size, self.backend = rank, size, "gloo"
        self.group = dist.group.WORLD

    @contextmanager
    def collectives(self):
        yield


def _measure_memory(one_step, strategy, device) -> dict:
    """One step's memory (gpulab.memory.step): the probe starts in one step and measures the
    next (copies in step take both steps together, as they take every step)."""
    measured = measure_step(one_step, device, strategy.replicas, strategy.optimizers)
    return {**{k: measured[k] for k in ("peak", "at_peak", "sizes", "batch")},
            "largest_unit": largest_unit_bytes(strategy.replicas[0])}


def _parameter_bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def unit_bytes(model) -> list[int]:
    """The parameter bytes of each unit --shard fsdp would wrap, then what the root holds itself."""
    units = [_parameter_bytes(u) for u in shard_units(model)]
    return units + [_parameter_bytes(model) - sum(units)]


def largest_unit_bytes(model) -> int:
    """The parameters of the largest part of the model that sharding would gather at once: the
    largest module holding at most half of the model's parameters (a layer of LeNet, a residual
    block of ResNet-18), or the whole model when no part is that small."""
    total = _parameter_bytes(model)
    parts = [_parameter_bytes(m) for m in model.modules() if m is not model and 0 < _parameter_bytes(m) <= total / 2]
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
    group = dist.new_group(backend="gloo")  # apart from the handshakes' group
    exchange.connect(group)

    def idle_allreduce_s(flat) -> float:
        message, times = flat.clone(), []
        for _ in range(3):
            start = time.perf_counter()
            dist.all_reduce(message, group=group)
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
    main(json.loads(sys.argv[1]))
