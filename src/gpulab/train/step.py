"""One training step and one evaluation, for every way of running them.

    Trainer.train_step   forward and loss per micro-batch and replica, the scaled backward, the
                         gradient exchange finished, the optimizer step
    Trainer.evaluate     loss and accuracy over a test set, every sample counted once
    Trainer.step         train_step, or on one GPU (--compile record, graphs) its CUDA-graph replay

How gradients meet is the strategy's business (gpulab.parallel: in-process replicas, gpulab's
sync across ranks, DDP, FSDP2); the step only asks it, in the same words for all of them, to
split a batch, to exchange during the last backward and to finish. Every strategy thus runs
this one step, and computes what one model stepped by plain PyTorch computes on the same
global batches.

Also here, what a step measures: its phases' times (PhaseTimer) and its running loss and
top-1 hits on the device (Meter), read once per epoch.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, contextmanager
from functools import partial

import torch

from gpulab.errors import UserError
from gpulab.parallel.graphed import StepGraph
from gpulab.parallel.strategy import Strategy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Trainer:
    """What every step of a run uses: the strategy, the loss, the precision, the accumulation,
    the compiled or eager forward, the phase timer.

    `autocast`: forward under torch.autocast with this dtype (parameters, gradients and the
    optimizer stay fp32); None for a sharded strategy, whose FSDP policy casts instead.
    `accumulate`: each batch computed as this many micro-batches, one after another.
    `compile`: "off"; "record": the eager step, optimizer included, recorded once as one CUDA
    graph and replayed (StepGraph; one GPU, one micro-batch); "on": the forward and loss through
    torch.compile (AOTAutograd compiles their backward too); "graphs": also replayed as CUDA
    graphs - and on one GPU with one micro-batch the whole compiled step recorded as one."""

    def __init__(self, strategy: Strategy, loss_fn: LossFn, autocast: torch.dtype | None = None,
                 accumulate: int = 1, compile: str = "off", timer: PhaseTimer | None = None):
        self.strategy, self.loss_fn, self.autocast, self.accumulate = strategy, loss_fn, autocast, accumulate
        one_part = len(strategy.devices) == 1 and strategy.num_replicas == 1 and accumulate == 1
        whole = compile == "record" or (compile == "graphs" and one_part)  # compile_mode: record is one part
        if compile == "record":
            forward = "off"  # the eager step is what is recorded
        elif compile == "graphs" and whole:
            forward = "on"  # inside the step's recording, torch.compile's own CUDA graphs would be graphs in a graph
        else:
            forward = compile
        self.forward = Forward(forward)
        self.graph = None
        self.timer = timer or PhaseTimer(strategy.devices, enabled=False)
        if whole:  # a replay is one piece of work: untimed
            self.timer = PhaseTimer([], enabled=False)
            self.graph_meter = Meter(strategy.devices[0])
            self.graph = StepGraph(self._recorded_step, strategy.replicas, strategy.optimizers, strategy.devices[0])

    def set_lr(self, lr: float) -> None:
        for opt in self.strategy.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        if self.graph is not None:
            self.graph.set_lr(lr)

    def step(self, X: torch.Tensor, y: torch.Tensor, meter: Meter | None = None) -> None:
        """One training step: train_step, or the replay of its recording."""
        if self.graph is None:
            self.train_step(X, y, meter)
            return
        totals, = self.graph(X, y)  # the graph's own tensor: rewritten by the next replay
        if meter is not None:
            meter.add_totals(totals, len(y))

    def train_step(self, X: torch.Tensor, y: torch.Tensor, meter: Meter | None = None) -> torch.Tensor:
        """One synchronized optimizer step on this process's part (X, y) of a global batch;
        returns this process's share of the batch's mean loss, on the device. Never reads the
        device. Each part's mean loss is weighted by its share of the global batch, so the
        gradients the strategy sums are those of the global batch's mean loss."""
        strategy, timer, first = self.strategy, self.timer, self.strategy.devices[0]
        batch = strategy.global_batch(len(y))
        weighted_loss = partial(self._weighted_loss, batch=batch)
        total = torch.zeros((), device=first)
        with strategy.collectives():
            strategy.zero_grad()
            parts = micro_batches(X, y, self.accumulate)
            for j, (X_micro, y_micro) in enumerate(parts):
                with timer.phase("scatter"):
                    shards = strategy.split(X_micro, y_micro)
                with timer.phase("forward_backward"), strategy.exchanging(last=j == len(parts) - 1):
                    outs = strategy.each(weighted_loss, shards)
                    losses = [loss for loss, _ in outs]
                    scaled = [loss * strategy.loss_scale for loss in losses] if strategy.loss_scale != 1 else losses
                    torch.autograd.backward(scaled)
                loss = sum(l.detach().to(first) for l in losses)
                total = total + loss
                if meter is not None:
                    meter.add(loss * batch, sum(c.to(first) for _, c in outs), len(y_micro))
            with timer.phase("allreduce"):  # what was not exchanged during backward
                skip_unused = strategy.finish_exchange()
            with timer.phase("optimizer"), skip_unused:
                for opt in strategy.optimizers:
                    opt.step()
        return total

    def _weighted_loss(self, model, X: torch.Tensor, y: torch.Tensor, batch: int):
        mean, correct = self.forward(model, X, y, self.loss_fn, self.autocast)
        return mean * (len(y) / batch), correct

    def _recorded_step(self, X: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor]:
        """train_step as the CUDA graph records it: the metrics into a meter of the graph's own."""
        self.graph_meter.totals.zero_()
        self.train_step(X, y, self.graph_meter)
        return (self.graph_meter.totals,)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_fn: LossFn | None = None) -> dict:
        """Loss and accuracy over every sample of `batches` of every process, each counted once
        (collective). Each batch is split over this process's replicas; one smaller than their
        number goes whole to the first."""
        strategy, first = self.strategy, self.strategy.devices[0]
        strategy.sync_buffers()
        strategy.train(False)
        meter = Meter(first)
        with strategy.collectives():
            for X, y in batches:
                shards = strategy.split(X, y) if len(y) >= len(strategy.replicas) else [(X.to(first), y.to(first))]
                sums = [eval_batch(model, X_part, y_part, loss_fn, self.autocast)
                        for model, (X_part, y_part) in zip(strategy.replicas, shards)]
                meter.add(sum(l.to(first) for l, _ in sums), sum(c.to(first) for _, c in sums), len(y))
        strategy.train(True)
        return self.read(meter)

    def read(self, meter: Meter) -> dict[str, float]:
        """The meter's totals over every replica of the job, read on the host (collective)."""
        totals = torch.cat([meter.totals, meter.totals.new_tensor([meter.count])])
        self.sum_over_processes(totals)
        return summarize(*totals.tolist())

    def sum_over_processes(self, t: torch.Tensor) -> None:
        """`t` summed in place over every process of the job (a collective; nothing to do alone)."""
        with self.strategy.collectives():
            self.strategy.sum_over_processes(t)


def micro_batches(X: torch.Tensor, y: torch.Tensor, accumulate: int):
    """`accumulate` micro-batches of (X, y), computed one after another to save memory."""
    parts = min(accumulate, len(y))
    return list(zip(torch.tensor_split(X, parts), torch.tensor_split(y, parts)))


def autocast(device: torch.device, dtype: torch.dtype | None):
    """Mixed precision on `device` when `dtype` is given (parameters and gradients stay fp32)."""
    # autocast keeps its casts of the weights for the region; made while a graph records, they are
    # the graph's memory (torch asks for cache_enabled=False around make_graphed_callables): no cache then
    recording = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None, cache_enabled=not recording)


def forward_and_loss(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                     dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean loss, top-1 hits) of one part, on its device; the loss inside autocast too (it
    computes it in fp32)."""
    with autocast(X.device, dtype):
        out = model(X)
        loss = loss_fn(out, y)
    return loss, correct_count(out, y)


def eval_batch(model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn | None,
               dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss sum, correct count) of one batch, on its device."""
    with autocast(X.device, dtype):
        out = model(X)
        loss_sum = loss_fn(out, y) * len(y) if loss_fn is not None else torch.zeros((), device=X.device)
    return loss_sum, correct_count(out, y)


class Forward:
    """forward_and_loss, eager ("off") or through torch.compile ("on"; "graphs": its CUDA graphs,
    mode="reduce-overhead", the kernel launches of a step one replay). Shapes are static (every
    training batch has the same size: GlobalBatches drops the remainder); a part of another size
    (an uneven split over devices) is one more compile. The loss's first call runs eagerly: it
    checks its inputs with one host read (CheckedLoss), which would break the graph."""

    def __init__(self, compile: str = "off"):
        self.compile = compile
        self.compiled = None
        if compile != "off":
            mode = "reduce-overhead" if compile == "graphs" else None
            self.compiled = torch.compile(forward_and_loss, mode=mode, dynamic=False)

    def __call__(self, model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor, loss_fn: LossFn,
                 dtype: torch.dtype | None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.compiled is None or (isinstance(loss_fn, CheckedLoss) and not loss_fn.checked):
            return forward_and_loss(model, X, y, loss_fn, dtype)
        if self.compile == "graphs":
            # a new step: the previous replay's outputs (already consumed) may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        return self.compiled(model, X, y, loss_fn, dtype)


class CheckedLoss:
    """The loss function, checked on its first call: one-line errors instead of a broadcast error or
    a silently wrong gradient deep in the step. Also learns whether accuracy applies (class scores
    for integer labels), from shapes alone."""

    def __init__(self, loss_fn: LossFn):
        self.loss_fn = loss_fn
        self.checked = False
        self.classifies = True

    def __call__(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.checked:
            return self.loss_fn(outputs, targets)
        if not isinstance(outputs, torch.Tensor):
            raise UserError(f"the model returned a {type(outputs).__name__}: gpulab trains models whose forward "
                            "returns one tensor (wrap the model to return the one the loss takes)")
        if outputs.shape[:1] != targets.shape[:1]:
            raise UserError(f"the model's outputs have batch size {outputs.shape[0] if outputs.dim() else 'none'} "
                            f"(shape {tuple(outputs.shape)}) but the labels have {targets.shape[0] if targets.dim() else 'none'}: "
                            "the first dimension of both must be the batch")
        if classifies(outputs, targets) and len(targets):
            # One host read, on the first step only: labels the class scores cannot index give
            # an IndexError deep in cross_entropy otherwise.
            low, high = torch.stack([targets.min(), targets.max()]).tolist()
            if low < 0 or high >= outputs.shape[1]:
                raise UserError(f"labels run from {low} to {high}, but the model gives {outputs.shape[1]} class scores "
                                f"(labels must be 0..{outputs.shape[1] - 1}; the built-in models have 10 classes): "
                                "relabel the data or use a model with more outputs")
        loss = self.loss_fn(outputs, targets)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise UserError(f"the loss returned {shape}, not one number: gpulab needs the batch's mean loss "
                            "(e.g. reduction='mean', PyTorch's default)")
        self.classifies = classifies(outputs, targets)
        self.checked = True
        return loss


# ----------------------------------------------------------------------------- what a step measures


class Meter:
    """Running loss sum and correct count on the device; the sample count is known on the host.

    Read once per epoch (`Trainer.read`: over every replica of the job); its loss sum doubles as
    the non-finite flag that `FiniteWatch` reads every so many steps."""

    def __init__(self, device: torch.device):
        self.totals = torch.zeros(2, dtype=torch.float64, device=device)
        self.count = 0

    def add(self, loss_sum: torch.Tensor, correct: torch.Tensor, count: int) -> None:
        self.totals += torch.stack([loss_sum.double(), correct.double()])
        self.count += count

    def add_totals(self, totals: torch.Tensor, count: int) -> None:
        """Another meter's (loss sum, correct count) over `count` samples."""
        self.totals += totals
        self.count += count


class FiniteWatch:
    """Whether every training step so far had a finite loss, read every so many steps without a
    per-step host sync and, on a GPU, without making the device wait at all.

    The flag is the meter's running loss sum itself, accumulated on the device with the metrics:
    NaN and +-inf stay in a sum once they are in it, so a finite sum means every step's loss was
    finite, at no extra cost per step. `poll()` starts copying the sum to the host (summed over
    every rank first by `combine`, a collective in step order, so that every rank reads the same
    value at the same step and all stop together) and returns what the previous poll copied: on a
    GPU that copy finished long ago (it only waited for the steps before it), so reading it costs
    nothing; elsewhere the value is read at once."""

    def __init__(self, meter: Meter, combine: Callable[[torch.Tensor], None] | None = None):
        self.meter = meter
        self.combine = combine
        self.device = meter.totals.device
        self.pending: tuple[torch.Tensor, torch.cuda.Event, int] | None = None

    def poll(self, step: int) -> tuple[float, int] | None:
        """(the loss sum, the step it was taken after) once it is not finite, else None."""
        snapshot = self.meter.totals[:1].clone()
        if self.combine is not None:
            self.combine(snapshot)
        if self.device.type != "cuda":
            return _non_finite(snapshot.item(), step)
        host = torch.empty(1, dtype=snapshot.dtype, pin_memory=True)
        host.copy_(snapshot, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        previous, self.pending = self.pending, (host, event, step)
        if previous is None:
            return None
        host, event, step = previous
        event.synchronize()  # long done: it followed the steps before the previous poll
        return _non_finite(host.item(), step)  # host memory: no device sync


def _non_finite(value: float, step: int) -> tuple[float, int] | None:
    return None if math.isfinite(value) else (value, step)


def summarize(loss_sum: float, correct: float, count: float) -> dict[str, float]:
    return {"loss": loss_sum / max(count, 1), "accuracy": correct / max(count, 1), "count": int(count)}


def classifies(outputs: torch.Tensor, targets: torch.Tensor) -> bool:
    """Class scores (N, C) for integer labels (N,): top-1 accuracy means something. Read from
    shapes and dtypes only, never from values (no host sync)."""
    return outputs.dim() == 2 and targets.dim() == 1 and not (targets.is_floating_point() or targets.is_complex())


def correct_count(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Top-1 hits on the device; zero where accuracy does not apply (regression, sequences, ...)."""
    if classifies(outputs, targets):
        return (outputs.argmax(1) == targets).sum()
    return torch.zeros((), dtype=torch.long, device=outputs.device)


PhaseListener = Callable[[str], AbstractContextManager]
"""Called as a phase begins, with its name; the context manager it returns is entered around the phase."""

_listeners: list[PhaseListener] = []


def add_phase_listener(listener: PhaseListener) -> Callable[[], None]:
    """Subscribe `listener` to every phase from now on; returns the function that unsubscribes it."""
    _listeners.append(listener)

    def remove() -> None:
        if listener in _listeners:
            _listeners.remove(listener)

    return remove


class PhaseTimer:
    """Time the phases of a training step without stalling the device.

    On CUDA a wall-clock timer around `loss.backward()` measures how long the *launch* took, and
    charges the GPU time to whichever later call happens to synchronize. So on CUDA each phase is
    bracketed by CUDA events recorded on the device's stream, and the elapsed times are read once,
    at `summary()`, after a single synchronize. On the CPU, work is synchronous and wall-clock is
    right.

    Phase listeners (`add_phase_listener`) see every phase of every PhaseTimer in the process,
    timed or not, the way torch's global module hooks see every module: the profiler subscribes to
    learn gpulab's own trainer's phases (data, scatter, forward_backward, allreduce, optimizer)
    without patching it."""

    def __init__(self, devices: list[torch.device], enabled: bool = True):
        """`enabled=False`: time nothing (listeners still see the phases)."""
        self.devices = list(dict.fromkeys(devices))  # unique, in order
        self.enabled = enabled
        self.cuda = any(d.type == "cuda" for d in self.devices)
        self.reset()

    def reset(self) -> None:
        self._events: dict[str, list[tuple]] = defaultdict(list)
        self._wall: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        """Time the block as phase `name`, inside what the phase listeners wrap around it."""
        if not _listeners:
            with self._timed(name):
                yield
            return
        with ExitStack() as stack:
            for listener in list(_listeners):
                stack.enter_context(listener(name))
            with self._timed(name):
                yield

    @contextmanager
    def _timed(self, name: str):
        if not self.enabled:
            yield
        elif self.cuda:
            starts = [self._record(d) for d in self.devices]
            yield
            ends = [self._record(d) for d in self.devices]
            self._events[name].append((starts, ends))
        else:
            t0 = time.perf_counter()
            yield
            self._wall[name] += time.perf_counter() - t0

    @staticmethod
    def _record(device: torch.device):
        if device.type != "cuda":
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(device))
        return e

    def summary(self) -> dict[str, list[float]]:
        """Seconds per phase, one entry per device (CPU: one entry). Synchronizes once."""
        out: dict[str, list[float]] = {k: [v] for k, v in self._wall.items()}
        if self._events:
            for d in self.devices:
                if d.type == "cuda":
                    torch.cuda.synchronize(d)
            for name, pairs in self._events.items():
                per_device = [0.0] * len(self.devices)
                for starts, ends in pairs:
                    for j, (s, e) in enumerate(zip(starts, ends)):
                        per_device[j] += (e - s) if isinstance(s, float) else s.elapsed_time(e) / 1000
                out[name] = per_device
        return out
