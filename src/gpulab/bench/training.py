"""training: what a user feels - the 10-epoch LeNet demo (`gpulab train`, default options) against
the textbook's chapter (its port, gpulab.bench.textbook) and against the script a user would
otherwise write (the fastest plain-PyTorch LeNet an expert writes by hand, gpulab.bench.by_hand), on
the same data, each as a whole process - start-up, data, compiling and evaluation included - as a
user runs it.

Per device, `rounds` rounds; in each, every contender runs in turn (interleaved, so that the
machine's drift hits all alike), twice: a FIRST run with empty caches - a new, empty folder as its
XDG_CACHE_HOME (gpulab's cache, gpulab.io.cache_dir(): its bytecode cache where the install needs
one, its decoded data) and under it TORCHINDUCTOR_CACHE_DIR (torch.compile's; Triton's kernels go
under it) - and right after it a SECOND run of the same command on the same folder: what a user's
next run finds. The contenders: the textbook's port (per-sample DataLoader with 4 workers,
functional LeNet, manual SGD, a sync per batch), the script by hand (the data on the device,
channels_last, bf16 where native, gpulab's recipe, the whole step a CUDA graph on a GPU), `gpulab
train` as it is, and on CUDA `gpulab train --compile off`, `--compile on` and `--compile graphs`
(Config.compiled says why not on the CPU); each trains `epochs` epochs.

A row (a contender's first or second run) gives the medians over the rounds: the whole process's
seconds [min .. max] and their ratio to the textbook's (its run of the same kind), round by round
[min .. max] - the headline; the time to the first training step (seconds from the process's
creation until its first step had finished on the device); the time to TARGET_ACC (0.90) test
accuracy, DAWNBench's and airbench's measure (seconds from the process's creation to the end of
the first epoch whose evaluation reached it; a round that never reached it counts as longer than
any that did, so the median is "not reached" once half the rounds missed it); the steady epoch (the
median training seconds of the epochs after the first) and the test accuracy after the last
epoch. A second table says where the time went: the training seconds per epoch (gpulab's
metrics.json, compile time apart; the textbook's own clock around its training loop - evaluation
is timed apart in both, with a column of its own), the compile seconds, the process's seconds
outside its epochs and compiling (start-up, checkpoints, exit), and the ratio of the training
seconds per epoch to the textbook's, round by round. `result.summary` holds every figure. The
processes time those moments from their own creation (gpulab.host.seconds_since_start). The tiny
preset (a smoke test) runs the textbook and eager `gpulab train` only.

The floor beside the rows: LeNet's multiply-adds per sample (its layers' shapes, forward, and
twice that for backward: ~13.5 MFLOP per training sample) times the epoch's samples, over the
device's own peak as measured here (a large matmul in fp32, and in bf16 where autocast uses it):
the seconds an epoch would take if every FLOP ran at matmul speed. And a floor that torch's kernels
set: LeNet's convolutions and linear layers as a step of `gpulab train` calls them (its batch, its
layout), forward and backward, each timed alone, times the epoch's steps - what no loop around
those kernels can beat, however well it fuses the rest (the pooling, the activations, the loss,
the optimizer, the Python).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpulab import data, models
from gpulab.config import TrainConfig
from gpulab.data.fashion_mnist import find, write_subset
from gpulab.bench.harness import measure, summarize
from gpulab.bench.result import Column, Result, figure, fmt_seconds
from gpulab.devices import format_devices, native_bf16
from gpulab.io import cache_dir
from gpulab.train.precision import use_channels_last

LESSON = (
    "Keeping the dataset on the device, reading nothing back inside the epoch and fusing the step "
    "beat the textbook's per-sample pipeline several times over, whole process against whole process."
)

DEFAULT, COMPILED, GRAPHS, TEXTBOOK = "gpulab train", "gpulab train --compile on", "gpulab train --compile graphs", "textbook"
"""What `make demo` runs: the step eager on a CPU, recorded as a CUDA graph on one GPU."""
BY_HAND = "plain PyTorch, by hand"
"""The script a user would otherwise write (by_hand.py)."""
UNRECORDED = "gpulab train --compile off"
"""On a GPU, the eager step as it runs, unrecorded: what the default's recording wins."""
FIRST, SECOND = "first", "second"
RUNS = {FIRST: "first run (empty caches)", SECOND: "second run"}
"""Each contender runs twice a round: with a new, empty cache folder, then again on what it left."""
TARGET_ACC = 0.90
"""The test accuracy a run's time-to-accuracy is measured to (the recipe's known result in 10 epochs)."""


@dataclass(kw_only=True)
class Config:
    epochs: int = 10
    """Epochs per run: 10 gives the accuracy the recipe is known for (>= 0.90)."""
    rounds: int = 3
    samples: int | None = None
    """Training samples (None: the whole of Fashion-MNIST); fewer for smoke tests."""
    timeout_s: float = 3600.0
    compiled: bool = True
    """Also, on a GPU, `gpulab train --compile on` and `--compile graphs`. Not on the CPU: there
    compiled epochs ran 0-8% faster for 5-20 s of compiling (docs/benchmarks.md, "Where the
    defaults come from"), which a 10-epoch demo never wins back, and each such run takes minutes.
    The tiny preset leaves them out everywhere: tests/train/test_compile.py checks compiled
    training on its own."""
    by_hand: bool = True
    """Also the script by hand. The tiny preset leaves it out: tests/bench/test_by_hand.py runs it
    as a process of its own."""


PRESETS = {
    "full": {},
    "quick": dict(epochs=1, rounds=2),
    "tiny": dict(epochs=1, rounds=1, samples=1024, timeout_s=600.0, compiled=False, by_hand=False),
}


# The commands after `python`. The script by hand runs by its path, as a user runs a script of their own.
GPULAB_TRAIN = ["-m", "gpulab", "train"]
TEXTBOOK_SCRIPT = ["-m", "gpulab.bench.textbook"]
BY_HAND_SCRIPT = [str(Path(__file__).with_name("by_hand.py"))]


def contenders(device: torch.device, compiled: bool = True, by_hand: bool = True) -> dict[str, list[str]]:
    """Name -> the command after `python`: `gpulab train ...`, or a script that takes EPOCHS DEVICE
    DATA_DIR and prints its figures as one JSON line (the textbook's port, the script by hand)."""
    spec = format_devices([device]).strip("[]")
    gpulab = [*GPULAB_TRAIN, "--devices", spec]
    found = {TEXTBOOK: TEXTBOOK_SCRIPT, **({BY_HAND: BY_HAND_SCRIPT} if by_hand else {}), DEFAULT: gpulab}
    if device.type == "cuda":
        found[UNRECORDED] = [*gpulab, "--compile", "off"]
    if compiled and device.type == "cuda":
        found[COMPILED] = [*gpulab, "--compile", "on"]
        found[GRAPHS] = [*gpulab, "--compile", "graphs"]
    return found


def cache_env(folder: Path) -> dict[str, str]:
    """The environment of a contender's process whose caches are all in `folder`: gpulab's
    (XDG_CACHE_HOME) and torch.compile's (TORCHINDUCTOR_CACHE_DIR, Triton's kernels under it). A
    bytecode prefix that gpulab's own start-up set for this process (bytecode.py) is not passed
    on: the child sets its own, in `folder`, as a user's command would; one the user set is moved
    into `folder`, so that no warm cache reaches a first run."""
    env = dict(os.environ)
    prefix = env.get("PYTHONPYCACHEPREFIX")
    if prefix is not None and Path(prefix) == cache_dir() / "pycache":
        del env["PYTHONPYCACHEPREFIX"]
    elif prefix is not None:
        env["PYTHONPYCACHEPREFIX"] = str(folder / "pycache")
    env.pop("TRITON_CACHE_DIR", None)
    env.update(XDG_CACHE_HOME=str(folder), TORCHINDUCTOR_CACHE_DIR=str(folder / "torchinductor"))
    return env


def run_once(command: list[str], epochs: int, spec: str, data_dir: Path, out: Path, timeout_s: float,
             cache: Path | None = None) -> dict:
    """One contender as its own process, its caches in `cache` (a first run's: new and empty; None:
    the user's own, as they are): the whole process's seconds, and what it reports of itself, on
    this process's clock."""
    env = {**(os.environ if cache is None else cache_env(cache)), "GPULAB_DATA": str(data_dir)}
    script = command[:len(GPULAB_TRAIN)] != GPULAB_TRAIN
    if script:
        argv = [sys.executable, *command, str(epochs), spec, str(data_dir)]
    else:
        argv = [sys.executable, *command, "--epochs", str(epochs), "--out", str(out)]
    t0 = time.perf_counter()
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except BaseException:  # its time is up, or gpulab is stopped (Terminated, Ctrl-C): so is the run
            proc.kill()
            proc.communicate()
            raise
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {proc.returncode}: {stderr.strip().splitlines()[-1:]}")
    if script:
        ran = script_figures(json.loads(stdout.strip().splitlines()[-1]), wall)
    else:
        ran = gpulab_figures(json.loads((out / "metrics.json").read_text()), wall)
    return {**ran, "cache_bytes": None if cache is None else folder_bytes(cache)}


def gpulab_figures(rows: list[dict], wall: float) -> dict:
    """A `gpulab train` run's figures from its metrics.json rows (one per epoch)."""
    first_step = next((row["first_step_s"] for row in rows if row.get("first_step_s") is not None), None)
    return figures(wall, [row["train_seconds"] for row in rows], [row["eval_seconds"] for row in rows],
                   sum(row.get("compile_seconds", 0.0) for row in rows), rows[-1]["test_acc"],
                   first_step_s=first_step, epoch_walls=[row["wall_s"] for row in rows],
                   accuracies=[row["test_acc"] for row in rows])


def script_figures(told: dict, wall: float) -> dict:
    """The figures of the textbook's port or the script by hand, from the JSON line it prints
    (lists, one entry per epoch)."""
    return figures(wall, told["train_seconds"], told["eval_seconds"], 0.0, told["test_acc"][-1],
                   first_step_s=told["first_step_s"], epoch_walls=told["wall_s"], accuracies=told["test_acc"])


def figures(wall: float, train: list[float], evaluation: list[float], compile_s: float, test_acc: float, *,
            first_step_s: float | None = None, epoch_walls: Sequence[float] = (),
            accuracies: Sequence[float | None] = ()) -> dict:
    """One run's figures: medians per epoch, and `rest_s`, the process's seconds outside its epochs
    and compiling (start-up - imports, the device, the data - checkpoints, exit): where a process
    slower than its epochs goes; and the moments the process timed from its creation (its first
    step; each epoch's end, `epoch_walls`, with its test accuracy)."""
    return {"wall_s": wall, "train_s": statistics.median(train), "eval_s": statistics.median(evaluation),
            "compile_s": compile_s, "rest_s": wall - sum(train) - sum(evaluation) - compile_s,
            "test_acc": test_acc, "epochs": len(train),
            "first_step_s": first_step_s,
            "steady_s": steady_epoch(train),
            "to_acc_s": time_to_accuracy(list(epoch_walls), accuracies)}


def steady_epoch(train: list[float]) -> float | None:
    """The median training seconds per epoch after the first (which pays for warming up, and for
    compiling where the clock does not take it apart); None for a run of one epoch."""
    return statistics.median(train[1:]) if len(train) > 1 else None


def time_to_accuracy(epoch_walls: list[float], accuracies: list[float | None], target: float = TARGET_ACC) -> float | None:
    """When the first epoch whose test accuracy reached `target` ended, in seconds since the
    process started (its `epoch_walls`); None when no epoch did."""
    if len(epoch_walls) != len(accuracies):
        raise ValueError(f"{len(epoch_walls)} epochs' ends but {len(accuracies)} test accuracies")
    return next((wall for wall, acc in zip(epoch_walls, accuracies) if acc is not None and acc >= target), None)


def folder_bytes(folder: Path) -> int:
    """What the files under `folder` hold: what a run left in its caches."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def training_flops_per_sample() -> float:
    """LeNet's multiply-adds per sample from its layers (output positions x kernel x channels),
    x2 FLOPs, x3 for forward + backward (the input gradient and the weight gradient each cost
    about a forward)."""
    model = models.build("lenet")
    macs, size = 0, 28
    for layer in (model.conv1, model.conv2):
        size = size - layer.kernel_size[0] + 1
        macs += size * size * layer.out_channels * layer.in_channels * layer.kernel_size[0] * layer.kernel_size[1]
        size //= 2  # the 2x2 average pool
    macs += sum(fc.in_features * fc.out_features for fc in (model.fc1, model.fc2))
    return 2 * 3 * macs


def peak_flops(device: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a large matmul on `device` in `dtype`: what the device can do at best, here."""
    n = 2048
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    timing = measure(lambda: a @ b, [device], repeats=5, max_total_s=3.0)
    return 2 * n**3 / timing.median_s


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table("training", f"LeNet, {cfg.epochs} epoch(s) per run, {cfg.rounds} round(s), whole processes: "
                         "each contender's first run with empty caches, its second right after on what the first left "
                         "(medians [min .. max] over the rounds; times from the process's start)", [
        Column("device", "device"), Column("run", "run"), Column("contender", "contender"),
        Column("whole", "whole process [min .. max]"), Column("vs", "vs textbook [min .. max]"),
        Column("first_step_s", "to first step", "seconds"), Column("to_acc", f"to {TARGET_ACC:.2f} test acc"),
        Column("steady_s", "steady epoch", "seconds"), Column("test_acc", "test acc", "num"),
    ])
    # where each process's time went (the same rows' other keys)
    parts = result.table("training-parts", "Where the time went: medians per run over the rounds", [
        Column("device", "device"), Column("run", "run"), Column("contender", "contender"),
        Column("train_s", "s/epoch, training", "seconds"), Column("eval_s", "s/epoch, evaluation", "seconds"),
        Column("compile_s", "compiling", "seconds"), Column("rest_s", "start-up and the rest", "seconds"),
        Column("train_vs", "vs textbook, training [min .. max]"),
    ])
    if not cfg.compiled:
        result.skip("compiled rows (gpulab train --compile on/graphs)", "left out of this preset: compiling takes "
                    "longer than its epoch (run the full or quick preset)")
    elif any(d.type == "cpu" for d in ctx.single_devices()):
        result.skip("compiled rows on the CPU (gpulab train --compile on)", "compiled epochs ran 0-8% faster there for "
                    "5-20 s of compiling (docs/benchmarks.md, Where the defaults come from): run on a GPU")
    if not any(d.type == "cuda" for d in ctx.single_devices()):
        result.skip("GPU rows (the same contenders on a GPU, and --compile on/graphs: the step replayed as a CUDA graph)",
                    ctx.no_gpu_reason())
    summary = {}
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-training-") as tmp:
        data_dir = data_folder(Path(tmp) / "data", cfg.samples)
        samples = len(data.load(data_dir)[0])
        for device in ctx.single_devices():
            spec = format_devices([device]).strip("[]")
            runs: dict[str, dict[str, list[dict]]] = {FIRST: {}, SECOND: {}}
            for r in range(cfg.rounds):
                for name, command in contenders(device, cfg.compiled, cfg.by_hand).items():
                    tag = f"{spec.replace(':', '')}-{r}-{name.split()[-1]}"
                    cache = Path(tmp) / f"cache-{tag}"
                    cache.mkdir()  # new and empty: the first run's
                    for kind in (FIRST, SECOND):  # the second right after the first, on the caches it left
                        ctx.progress(f"training {spec} round {r + 1}/{cfg.rounds}: {name}, {RUNS[kind]}")
                        ran = run_once(command, cfg.epochs, spec, data_dir, Path(tmp) / f"run-{tag}-{kind}",
                                       cfg.timeout_s, cache=cache)
                        # a run that stopped early would look fast: each must have trained every epoch
                        result.check(f"{spec}: {name} trained {cfg.epochs} epoch(s), {RUNS[kind]}", ran["epochs"],
                                     cfg.epochs, rtol=0, atol=0)
                        runs[kind].setdefault(name, []).append(ran)
                    shutil.rmtree(cache)
            # the same training recorded, compiled or not: the same accuracy, within reordering noise
            for kind in (FIRST, SECOND):
                for other in (UNRECORDED, COMPILED):
                    for r_default, r_other in zip(runs[kind][DEFAULT], runs[kind].get(other, [])):
                        result.check(f"{spec}: test accuracy {other} == {DEFAULT}, {RUNS[kind]}", r_other["test_acc"],
                                     r_default["test_acc"], rtol=0, atol=0.02)
            summary[spec] = {kind: _rows(table, spec, kind, runs[kind], cfg.epochs, parts) for kind in (FIRST, SECOND)}
            summary[spec]["runs"] = runs  # each run's own figures, round by round (`figures`)
            summary[spec]["floor"] = _floor(result, device, samples)
    result.summary = {"target_acc": TARGET_ACC, "devices": summary,
                      "headline": "; ".join(headline(spec, rows) for spec, rows in summary.items())}


def headline(spec: str, rows: dict) -> str:
    """The demo as a user feels it: `gpulab train` with its default options against the textbook,
    whole process against whole process, on a first run (empty caches) and the second; and when
    each had finished its first training step and reached TARGET_ACC. `rows`: summary[spec], each
    kind of run's rows by contender (`compare`)."""
    def versus(kind: str, key: str, never: str = "-") -> str:
        ours, theirs = (rows[kind][name][key] for name in (DEFAULT, TEXTBOOK))
        return f"{_seconds(ours, never)} vs {_seconds(theirs, never)}"

    def ratio(kind: str) -> str:
        ours = rows[kind][DEFAULT]
        return f"{ours['ratio']:.2f}x [{ours['ratio_min']:.2f} .. {ours['ratio_max']:.2f}]"

    line = (f"{spec}: gpulab train vs the textbook, whole process: first run (empty caches) "
            f"{versus(FIRST, 'wall_s')}, {ratio(FIRST)}; second run {versus(SECOND, 'wall_s')}, {ratio(SECOND)}; "
            f"to the first step {versus(FIRST, 'first_step_s')} (second run {versus(SECOND, 'first_step_s')}); "
            f"to test acc {TARGET_ACC:.2f} {versus(FIRST, 'to_acc_s', 'not reached')} "
            f"(second run {versus(SECOND, 'to_acc_s', 'not reached')})")
    return line + (by_hand_headline(rows) if BY_HAND in rows[FIRST] else "")


def by_hand_headline(rows: dict) -> str:
    """gpulab train against the script by hand: whole process (their medians' ratio: above 1x,
    gpulab is faster) and test accuracy, first run and second."""
    def versus(kind: str) -> str:
        ours, theirs = rows[kind][DEFAULT], rows[kind][BY_HAND]
        return (f"{_seconds(ours['wall_s'])} vs {_seconds(theirs['wall_s'])} ({theirs['wall_s'] / ours['wall_s']:.2f}x), "
                f"test acc {ours['test_acc']:.3f} vs {theirs['test_acc']:.3f}")

    return f"; vs plain PyTorch by hand, whole process: first run {versus(FIRST)}; second run {versus(SECOND)}"


def _seconds(s: float | None, never: str = "-") -> str:
    return never if s is None else fmt_seconds(s)


def over_rounds(values: list[float | None]) -> tuple[float | None, float | None, float | None]:
    """The median, min and max over the rounds of a time that a round may never have reached
    (None: counted as longer than any time; so is the result when it is such a round's)."""
    times = [math.inf if v is None else v for v in values]
    found = (statistics.median(times), min(times), max(times))
    return tuple(None if math.isinf(t) else t for t in found)


def compare(runs: dict[str, list[dict]], epochs: int) -> dict[str, dict]:
    """Each contender's medians over its rounds (`figures`), and its ratios to the textbook round
    by round, [min .. max]: of the whole process's seconds (the same as of its seconds per epoch),
    and of the training seconds per epoch alone (start-up, compiling and evaluation left out: what
    the step itself gained). `runs`: one kind of run (first or second), by contender."""
    median = statistics.median
    textbook = [r["wall_s"] for r in runs[TEXTBOOK]]
    textbook_train = [r["train_s"] for r in runs[TEXTBOOK]]
    rows = {}
    for name, measured in runs.items():
        walls = [r["wall_s"] for r in measured]
        # a contender with fewer runs (benchmarks/graphs_variants.py drops one that failed) pairs
        # with the textbook's first rounds
        ratios = [t / w for t, w in zip(textbook, walls)]
        train_ratios = [t / r["train_s"] for t, r in zip(textbook_train, measured)]
        row = {"contender": name, "wall_s": median(walls), "wall_s_min": min(walls), "wall_s_max": max(walls),
               "epoch_s": median(walls) / epochs,
               **{key: median(r[key] for r in measured)
                  for key in ("train_s", "eval_s", "compile_s", "rest_s", "test_acc")},
               "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
               "train_ratio": median(train_ratios), "train_ratio_min": min(train_ratios),
               "train_ratio_max": max(train_ratios)}
        for key in ("first_step_s", "steady_s", "to_acc_s"):
            row[key], row[f"{key}_min"], row[f"{key}_max"] = over_rounds([r.get(key) for r in measured])
        row["to_acc_rounds"] = sum(r.get("to_acc_s") is not None for r in measured)
        row["rounds"] = len(measured)
        caches = [r.get("cache_bytes") for r in measured]
        row["cache_bytes"] = None if None in caches else median(caches)
        rows[name] = row
    return rows


def to_accuracy_cell(row: dict) -> str:
    """The time to TARGET_ACC as the table shows it, with the rounds that reached it when not all did."""
    reached, rounds = row["to_acc_rounds"], row["rounds"]
    if row["to_acc_s"] is None:
        return "not reached" + (f" (reached in {reached}/{rounds} rounds)" if reached else "")
    return fmt_seconds(row["to_acc_s"]) + (f" ({reached}/{rounds} rounds)" if reached < rounds else "")


def _rows(table, spec: str, kind: str, runs: dict[str, list[dict]], epochs: int, parts=None) -> dict:
    """One kind of run's rows (`compare`) into `table`, every figure of each (the JSON's record), and
    into `parts` (where the time went) those that it shows."""
    rows = compare(runs, epochs)
    for name, row in rows.items():
        train_vs = f"{row['train_ratio']:.2f}x [{row['train_ratio_min']:.2f} .. {row['train_ratio_max']:.2f}]"
        # the whole process as a Timing too: its spread over the rounds beside the median
        table.add(device=spec, run=kind, **row, time=summarize([r["wall_s"] for r in runs[name]], inner=1, clock="wall"),
                  whole=f"{fmt_seconds(row['wall_s'])} [{row['wall_s_min']:.3g} .. {row['wall_s_max']:.3g}]",
                  vs=f"{row['ratio']:.2f}x [{row['ratio_min']:.2f} .. {row['ratio_max']:.2f}]",
                  to_acc=to_accuracy_cell(row), train_vs=train_vs)
        if parts is not None:
            parts.add(device=spec, run=kind, contender=row["contender"], train_vs=train_vs,
                      **{key: row[key] for key in ("train_s", "eval_s", "compile_s", "rest_s")})
    return rows


@dataclass(frozen=True)
class KernelCall:
    """A convolution or linear layer as a training step calls it."""
    layer: nn.Conv2d | nn.Linear
    input_shape: torch.Size
    input_needs_grad: bool
    """Does backward compute the input's gradient? Not for the first layer: its input is the data."""


def kernel_calls(model: nn.Module, batch: int) -> list[KernelCall]:
    """The model's convolutions and linear layers in the order a forward of `batch` images calls
    them, each with the input it gets (read by forward hooks)."""
    calls = []

    def record(layer, inputs, output):
        calls.append(KernelCall(layer, inputs[0].shape, inputs[0].requires_grad))

    hooks = [m.register_forward_hook(record) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    try:
        model(torch.zeros(batch, 1, 28, 28))
    finally:
        for hook in hooks:
            hook.remove()
    return calls


def kernel_seconds(call: KernelCall, device: torch.device, dtype: torch.dtype, channels_last: bool) -> float:
    """One layer's kernels in a step, timed alone: its forward, and its backward (the weight's and
    bias's gradients, and the input's where backward needs it)."""
    layer = call.layer
    layout = torch.channels_last if channels_last and len(call.input_shape) == 4 else torch.contiguous_format
    x = torch.randn(call.input_shape, device=device, dtype=dtype).to(memory_format=layout)
    x.requires_grad_(call.input_needs_grad)
    weight = layer.weight.detach().to(device, dtype, memory_format=layout).requires_grad_()
    bias = layer.bias.detach().to(device, dtype).requires_grad_()
    if isinstance(layer, nn.Conv2d):
        def forward():
            return F.conv2d(x, weight, bias, layer.stride, layer.padding, layer.dilation, layer.groups)
    else:
        def forward():
            return F.linear(x, weight, bias)
    out = forward()
    grad = torch.randn_like(out)
    wrt = [t for t in (x, weight, bias) if t.requires_grad]
    timings = [measure(fn, [device], repeats=5, max_total_s=1.0).median_s
               for fn in (forward, lambda: torch.autograd.grad(out, wrt, grad, retain_graph=True))]
    return sum(timings)


def kernel_floor(device: torch.device, dtype: torch.dtype, samples: int) -> dict:
    """An epoch of nothing but LeNet's convolution and matmul kernels, at `gpulab train`'s batch
    size and layout on `device` (its last, partial batch dropped, as the loader does)."""
    cfg = TrainConfig(devices=format_devices([device]).strip("[]"))
    channels_last = use_channels_last(cfg, [device])
    calls = kernel_calls(models.build("lenet"), cfg.batch_size)
    step_s = sum(kernel_seconds(call, device, dtype, channels_last) for call in calls)
    steps = max(1, samples // cfg.batch_size)
    return {"batch": cfg.batch_size, "channels_last": channels_last, "step_s": step_s, "epoch_s": steps * step_s}


def _floor(result: Result, device: torch.device, samples: int) -> dict:
    flops = training_flops_per_sample() * samples
    floor = {"flops_per_epoch": flops}
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if native_bf16(device) else {})}
    for name, dtype in dtypes.items():
        rate = peak_flops(device, dtype)
        floor[name] = {"peak_flop_s": rate, "epoch_s": flops / rate, "kernels": kernel_floor(device, dtype, samples)}
    spec = format_devices([device]).strip("[]")
    at_peak = ", ".join(f"{floor[name]['epoch_s']:.2f} s in {name} ({floor[name]['peak_flop_s'] / 1e9:.0f} GFLOP/s)"
                        for name in dtypes)
    result.note(f"{spec}: the floor - {flops / 1e9:.0f} GFLOP per epoch (LeNet, "
                f"{training_flops_per_sample() / 1e6:.1f} MFLOP per training sample) at this device's matmul peak: "
                f"{at_peak}" + ("" if "bf16" in dtypes else "; no native bf16 here (torch would emulate it), so no bf16 floor"))
    kernels = [floor[name]["kernels"] for name in dtypes]
    alone = ", ".join(f"{k['epoch_s']:.2f} s in {name} ({k['step_s'] * 1e3:.1f} ms a step)" for name, k in zip(dtypes, kernels))
    result.note(f"{spec}: the floor of torch's kernels - LeNet's convolutions and linear layers, forward and backward, "
                f"each timed alone at gpulab train's batch ({kernels[0]['batch']}, "
                f"{'channels_last' if kernels[0]['channels_last'] else 'NCHW'}): {alone} per epoch, before any pooling, "
                f"activation, loss, optimizer or Python")
    return floor


def data_folder(folder: Path, samples: int | None) -> Path:
    """Fashion-MNIST where it is found (the whole of it), or its first `samples` images."""
    if samples is None:
        return Path(find()["train_images"]).parent
    return write_subset(folder, samples, num_test=max(256, samples // 4))


def plot(result: Result):
    from matplotlib.patches import Patch

    fig, (ax,) = figure(width=7.5, height=4.2)
    rows = result.tables["training"].rows if "training" in result.tables else []
    width = 0.4
    hatches = {FIRST: "", SECOND: "//"}
    for offset, kind in zip((-width / 2, width / 2), (FIRST, SECOND)):
        these = [r for r in rows if r["run"] == kind]
        bars = ax.bar([i + offset for i in range(len(these))], [r["wall_s"] for r in these], width,
                      color=[{TEXTBOOK: "tab:gray", BY_HAND: "tab:orange"}.get(r["contender"], "tab:blue") for r in these],
                      hatch=hatches[kind], edgecolor="white")
        ax.bar_label(bars, [f"{r['ratio']:.2f}x" for r in these], fontsize=7)
    labels = [f"{r['device']}\n{r['contender'].replace('gpulab train', 'gpulab')}" for r in rows if r["run"] == FIRST]
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("seconds, whole process (x: vs the textbook)")
    ax.set_title("LeNet on Fashion-MNIST: the textbook's chapter, plain PyTorch by hand, gpulab train")
    ax.legend(handles=[Patch(facecolor="lightgray", edgecolor="black", hatch=hatches[kind], label=RUNS[kind])
                       for kind in (FIRST, SECOND)], fontsize=7, loc="upper right")
    ax.margins(y=0.12)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
