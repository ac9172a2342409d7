"""training: the textbook's LeNet chapter against `gpulab train`, eager and compiled, on the same
data, each as a whole process - start-up, data, compiling and evaluation included - as a user
runs it.

Per device, `rounds` rounds; in each, every contender runs once, in turn (interleaved, so that the
machine's drift hits all alike): the textbook's port (gpulab.bench.textbook: per-sample
DataLoader with 4 workers, functional LeNet, manual SGD, a sync per batch), `gpulab train` as it
is (eager), `gpulab train --compile on`, and on CUDA `--compile graphs`. Each trains `epochs`
epochs. A row gives the medians over the rounds, [min .. max]: the whole process's seconds per
epoch, the training seconds per epoch (gpulab's metrics.json, compile time apart; the
textbook's own clock around its training loop - evaluation is timed apart in both, and its
seconds per epoch are a column of their own), the compile seconds, the process's seconds outside
its epochs and compiling (start-up, checkpoints, exit), the test accuracy after the last epoch,
and the ratios to the textbook, round by round: of the whole process's seconds per
epoch, and of the training seconds per epoch alone (what the step gained, start-up and
evaluation left out). The tiny preset (a smoke test) runs the textbook and eager `gpulab train`
only.

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
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gpulab import data, models
from gpulab.config import TrainConfig
from gpulab.data.fashion_mnist import find, write_subset
from gpulab.bench.harness import measure, summarize
from gpulab.bench.report import Column, Result, figure
from gpulab.devices import format_devices, native_bf16
from gpulab.train.precision import use_channels_last

LESSON = (
    "Keeping the dataset on the device, reading nothing back inside the epoch and fusing the step "
    "beat the textbook's per-sample pipeline several times over, whole process against whole process."
)

EAGER, COMPILED, GRAPHS, TEXTBOOK = "gpulab train", "gpulab train --compile on", "gpulab train --compile graphs", "textbook"


@dataclass(kw_only=True)
class Config:
    epochs: int = 10
    """Epochs per run: 10 gives the accuracy the recipe is known for (>= 0.90)."""
    rounds: int = 3
    samples: int | None = None
    """Training samples (None: the whole of Fashion-MNIST); fewer for smoke tests."""
    timeout_s: float = 3600.0
    compiled: bool = True
    """Also `gpulab train --compile on` (and `graphs` on CUDA); the tiny preset leaves them out:
    compiling the step takes longer than its one small epoch, and tests/train/test_compile.py
    checks compiled training on its own."""


PRESETS = {
    "full": {},
    "quick": dict(epochs=1, rounds=2),
    "tiny": dict(epochs=1, rounds=1, samples=1024, timeout_s=600.0, compiled=False),
}


def contenders(device: torch.device, compiled: bool = True) -> dict[str, list[str]]:
    """Name -> the command after `python -m`."""
    spec = format_devices([device]).strip("[]")
    gpulab = ["gpulab", "train", "--devices", spec]
    found = {TEXTBOOK: ["gpulab.bench.textbook"], EAGER: gpulab}
    if compiled:
        found[COMPILED] = [*gpulab, "--compile", "on"]
        if device.type == "cuda":
            found[GRAPHS] = [*gpulab, "--compile", "graphs"]
    return found


def run_once(command: list[str], epochs: int, spec: str, data_dir: Path, out: Path, timeout_s: float) -> dict:
    """One contender as its own process: whole-process seconds, and what it reports of itself."""
    env_data = {"GPULAB_DATA": str(data_dir)}
    if command[0] == "gpulab.bench.textbook":
        argv = [sys.executable, "-m", *command, str(epochs), spec]
    else:
        argv = [sys.executable, "-m", *command, "--epochs", str(epochs), "--out", str(out)]
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **env_data})
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}")
    if command[0] == "gpulab.bench.textbook":
        told = json.loads(done.stdout.strip().splitlines()[-1])
        return figures(wall, told["train_seconds"], told["eval_seconds"], 0.0, told["test_acc"])
    rows = json.loads((out / "metrics.json").read_text())
    return figures(wall, [r["train_seconds"] for r in rows], [r["eval_seconds"] for r in rows],
                    sum(r.get("compile_seconds", 0.0) for r in rows), rows[-1]["test_acc"])


def figures(wall: float, train: list[float], evaluation: list[float], compile_s: float, test_acc: float) -> dict:
    """One run's figures: medians per epoch, and `rest_s`, the process's seconds outside its epochs
    and compiling (start-up - imports, the device, the data - checkpoints, exit): where a process
    slower than its epochs goes."""
    return {"wall_s": wall, "train_s": statistics.median(train), "eval_s": statistics.median(evaluation),
            "compile_s": compile_s, "rest_s": wall - sum(train) - sum(evaluation) - compile_s,
            "test_acc": test_acc, "epochs": len(train)}


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
    table = result.table("training", f"LeNet, {cfg.epochs} epoch(s) per run, {cfg.rounds} round(s), whole processes "
                         "(medians [min .. max] over the rounds)", [
        Column("device", "device"), Column("contender", "contender"),
        Column("epoch", "s/epoch, whole process", "time"), Column("train_s", "s/epoch, training", "seconds"),
        Column("eval_s", "s/epoch, evaluation", "seconds"), Column("compile_s", "compiling", "seconds"),
        Column("rest_s", "start-up and the rest", "seconds"),
        Column("test_acc", "test acc", "num"),
        Column("ratio", "vs textbook", "ratio"), Column("ratio_range", "[min .. max]"),
        Column("train_ratio", "vs textbook, training", "ratio"), Column("train_ratio_range", "[min .. max]"),
    ])
    if not cfg.compiled:
        result.skip("compiled rows (gpulab train --compile on/graphs)", "left out of this preset: compiling takes "
                    "longer than its epoch (run the full or quick preset)")
    if not any(d.type == "cuda" for d in ctx.single_devices()):
        result.skip("GPU rows (the same contenders on a GPU, and --compile graphs: the step replayed as a CUDA graph)",
                    ctx.no_gpu_reason())
    summary = {}
    with tempfile.TemporaryDirectory(prefix="gpulab-bench-training-") as tmp:
        data_dir = data_folder(Path(tmp) / "data", cfg.samples)
        samples = len(data.load(data_dir)[0])
        for device in ctx.single_devices():
            spec = format_devices([device]).strip("[]")
            runs: dict[str, list[dict]] = {}
            for r in range(cfg.rounds):
                for name, command in contenders(device, cfg.compiled).items():
                    ctx.progress(f"training {spec} round {r + 1}/{cfg.rounds}: {name}")
                    out = Path(tmp) / f"run-{spec.replace(':', '')}-{r}-{len(runs.get(name, []))}-{name.split()[-1]}"
                    ran = run_once(command, cfg.epochs, spec, data_dir, out, cfg.timeout_s)
                    # a run that stopped early would look fast: each must have trained every epoch
                    result.check(f"{spec}: {name} trained {cfg.epochs} epoch(s)", ran["epochs"], cfg.epochs, rtol=0, atol=0)
                    runs.setdefault(name, []).append(ran)
            # the same training compiled or not: the same accuracy, within float32 reordering
            for r_eager, r_compiled in zip(runs[EAGER], runs.get(COMPILED, [])):
                result.check(f"{spec}: test accuracy compiled == eager", r_compiled["test_acc"], r_eager["test_acc"],
                             rtol=0, atol=0.02)
            summary[spec] = _rows(table, spec, runs, cfg.epochs)
            summary[spec]["floor"] = _floor(result, device, samples)
    result.summary = {"devices": summary, "headline": "; ".join(headline(spec, rows) for spec, rows in summary.items())}


def headline(spec: str, rows: dict) -> str:
    """gpulab's fastest contender as a user would run it (whole process), and its fastest epochs:
    on a GPU they are not the same one (compiling and start-up outweigh a short run's epochs)."""
    ours = [row for name, row in rows.items() if name not in (TEXTBOOK, "floor")]
    whole = max(ours, key=lambda row: row["ratio"])
    epochs = max(ours, key=lambda row: row["train_ratio"])
    return (f"{spec}: {whole['contender']} {whole['ratio']:.2f}x the textbook per epoch, whole process "
            f"(test acc {whole['test_acc']:.3f}); in the epochs alone {epochs['contender']} "
            f"{epochs['train_ratio']:.2f}x (test acc {epochs['test_acc']:.3f})")


def compare(runs: dict[str, list[dict]], epochs: int) -> dict[str, dict]:
    """Each contender's medians over its rounds (`figures`), and its ratios to the textbook round
    by round, [min .. max]: of the whole process's seconds per epoch, and of the training seconds
    per epoch alone (start-up, compiling and evaluation left out: what the step itself gained)."""
    median = statistics.median
    textbook = [r["wall_s"] / epochs for r in runs[TEXTBOOK]]
    textbook_train = [r["train_s"] for r in runs[TEXTBOOK]]
    rows = {}
    for name, measured in runs.items():
        per_epoch = [r["wall_s"] / epochs for r in measured]
        ratios = [t / p for t, p in zip(textbook, per_epoch)]
        train_ratios = [t / r["train_s"] for t, r in zip(textbook_train, measured)]
        rows[name] = {"contender": name, "epoch_s": median(per_epoch),
                      **{key: median(r[key] for r in measured)
                         for key in ("train_s", "eval_s", "compile_s", "rest_s", "test_acc")},
                      "ratio": median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
                      "train_ratio": median(train_ratios), "train_ratio_min": min(train_ratios),
                      "train_ratio_max": max(train_ratios)}
    return rows


def _rows(table, spec: str, runs: dict[str, list[dict]], epochs: int) -> dict:
    rows = compare(runs, epochs)
    for name, row in rows.items():
        # the whole-process epoch as a Timing too: its spread over the rounds beside the median
        per_epoch = [r["wall_s"] / epochs for r in runs[name]]
        table.add(device=spec, **row, epoch=summarize(per_epoch, inner=1, clock="wall"),
                  ratio_range=f"[{row['ratio_min']:.2f} .. {row['ratio_max']:.2f}]",
                  train_ratio_range=f"[{row['train_ratio_min']:.2f} .. {row['train_ratio_max']:.2f}]")
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
    fig, (ax,) = figure(width=7.5, height=4.2)
    rows = result.tables["training"].rows if "training" in result.tables else []
    labels = [f"{r['device']}\n{r['contender'].replace('gpulab train', 'gpulab')}" for r in rows]
    bars = ax.bar(range(len(rows)), [r["epoch_s"] for r in rows],
                  color=["tab:gray" if r["contender"] == TEXTBOOK else "tab:blue" for r in rows])
    ax.bar_label(bars, [f"{r['ratio']:.2f}x" for r in rows], fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("seconds per epoch (whole process)")
    ax.set_title("LeNet on Fashion-MNIST: the textbook's chapter vs gpulab train")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
