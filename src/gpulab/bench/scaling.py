"""scaling: data-parallel training throughput for k = 1..n devices, LeNet and ResNet-18.

One step is gpulab train's (`Trainer.train_step` through DataParallel): split the batch over k devices,
forward/backward on each, allreduce the gradients (gpulab's auto choice: NCCL on GPUs), update
every replica. The batch is already on the first device (as `DeviceLoader` delivers it), and
it is synthetic: throughput does not depend on pixel values, and the benchmark needs no dataset.

Two ways to grow k, both reported:
- per-device batch fixed (weak scaling, `--scale-batch` in `gpulab train`): each device keeps
  the same amount of work; ideal samples/s grows as k. This is how more devices pay off.
- global batch fixed (strong scaling, the chapter's batch 256 on 1 and 2 GPUs): each device's
  share shrinks as k grows, until fixed per-step costs (launches, allreduce) dominate.
efficiency = samples/s at k / (k x samples/s at 1).

Correctness first: one step on k devices must produce the same parameters as one step on 1
device from the same start on the same batch, in float64 to 1e-9 (ResNet-18 is compared with
synchronized BatchNorm, which makes the k-device step the same computation; per-device
BatchNorm, used for the timing as in the trainer's default, normalizes each shard by its own
statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from gpulab import models
from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure
from gpulab.devices import cpu, format_devices
from gpulab.parallel import DataParallel
from gpulab.train.step import Trainer

LESSON = (
    "Data parallelism multiplies throughput when each device gets enough work per step; "
    "with small shards, fixed per-step costs and the allreduce eat the gain."
)


@dataclass(kw_only=True)
class Config:
    models: list[str] = field(default_factory=lambda: ["lenet", "resnet18"])
    gpu_batch: dict[str, int] = field(default_factory=lambda: {"lenet": 256, "resnet18": 128})
    """Per-device batch on GPUs (weak scaling), and the global batch at k=1 (strong scaling)."""
    cpu_batch: dict[str, int] = field(default_factory=lambda: {"lenet": 256, "resnet18": 32})
    """The same on the CPU, where a ResNet-18 sample costs ~30 ms."""
    cpu_replicas: int = 4
    """Virtual CPU replicas without --devices: k = 1..4 on cpu*4."""
    modes: list[str] = field(default_factory=lambda: ["per-device batch", "global batch"])
    parity_batch: int = 8
    warmup: int = 2
    repeats: int = 5
    min_sample_s: float = 0.2
    max_total_s: float = 6.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(
        cpu_batch={"lenet": 64, "resnet18": 4}, gpu_batch={"lenet": 256, "resnet18": 64}, cpu_replicas=2,
        modes=["per-device batch"], warmup=1, repeats=3, min_sample_s=0.02, max_total_s=0.5,
    ),
    "tiny": dict(
        models=["lenet"], cpu_batch={"lenet": 8}, gpu_batch={"lenet": 32}, cpu_replicas=2,
        modes=["per-device batch"], parity_batch=4, warmup=1, repeats=2, min_sample_s=0.0, max_total_s=0.05,
    ),
}


def pool(cfg: Config, ctx) -> list[torch.device]:
    """The devices k grows over: the GPUs, else virtual CPU replicas."""
    if ctx.devices is not None:
        if len(ctx.devices) == 1 and ctx.devices[0].type == "cpu":
            return [cpu()] * cfg.cpu_replicas
        return list(ctx.devices)
    return ctx.gpus() or [cpu()] * cfg.cpu_replicas


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table(
        "steps",
        "data-parallel train_step (forward, backward, allreduce, update)",
        [
            Column("model", "model"),
            Column("mode", "batch"),
            Column("devices", "devices"),
            Column("k", "k", "int"),
            Column("batch", "global batch", "int"),
            Column("time", "time per step", "time"),
            Column("samples_per_s", "samples/s", "rate"),
            Column("speedup", "vs k=1", "ratio"),
            Column("efficiency", "efficiency", "pct"),
        ],
    )
    devices = pool(cfg, ctx)
    if not ctx.gpus():
        result.skip("GPU rows", ctx.no_gpu_reason())
    if len(set(devices)) == 1 and len(devices) > 1:
        result.note(
            f"{format_devices(devices)} are virtual replicas sharing the same cores: k replicas do the same total "
            "work one after another, so samples/s cannot grow; the rows show correctness and the per-step overhead"
        )
    elif len(devices) == 1:
        result.note(f"only one device ({devices[0]}): k = 1 alone, no scaling to measure")
    on_gpu = devices[0].type == "cuda"
    benchmark_mode = torch.backends.cudnn.benchmark
    # Fixed shapes: let cuDNN pick its fastest kernels, as the trainer does (restored afterwards).
    torch.backends.cudnn.benchmark = on_gpu or benchmark_mode
    try:
        _run_models(cfg, ctx, result, table, devices, on_gpu)
    finally:
        torch.backends.cudnn.benchmark = benchmark_mode
    result.summary = summarize(table.rows)


def _run_models(cfg: Config, ctx, result: Result, table, devices: list[torch.device], on_gpu: bool) -> None:
    for name in cfg.models:
        _check_parity(cfg, result, name, devices)
        per_device = (cfg.gpu_batch if on_gpu else cfg.cpu_batch)[name]
        for mode in cfg.modes:
            base = None
            for k in range(1, len(devices) + 1):
                batch = per_device * k if mode == "per-device batch" else per_device
                if batch < k:
                    result.skip(f"{name} {mode} k={k}", f"a global batch of {batch} cannot be split over {k} devices")
                    continue
                ctx.progress(f"scaling {name} {mode} k={k}")
                t = _time_steps(cfg, name, devices[:k], batch)
                sps = batch / t.median_s
                base = base or sps
                table.add(
                    model=name, mode=mode, devices=format_devices(devices[:k]), k=k, batch=batch, time=t,
                    samples_per_s=sps, speedup=sps / base, efficiency=sps / (k * base),
                )
            if on_gpu:
                torch.cuda.empty_cache()


def _model(name: str, channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = models.build(name)
    # As the trainer does on CPU (oneDNN convolutions are faster on NHWC); off on CUDA fp32.
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _batch(n: int, device: torch.device, channels_last: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    if channels_last:
        X = X.contiguous(memory_format=torch.channels_last)
    return X.to(device), y.to(device)


def _time_steps(cfg: Config, name: str, devices: list[torch.device], batch: int):
    channels_last = devices[0].type == "cpu"
    dp = DataParallel(_model(name, channels_last), devices, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9))
    X, y = _batch(batch, devices[0], channels_last)
    trainer = Trainer(dp, nn.CrossEntropyLoss())
    # wall+sync at every k (also k=1 on one GPU): the same clock for every row of a curve
    return measure(
        lambda: trainer.train_step(X, y),
        devices,
        clock="wall+sync",
        warmup=cfg.warmup,
        repeats=cfg.repeats,
        min_sample_s=cfg.min_sample_s,
        max_total_s=cfg.max_total_s,
    )


def _check_parity(cfg: Config, result: Result, name: str, devices: list[torch.device]) -> None:
    """One data-parallel step on the k devices == one plain PyTorch step (one model, the whole batch,
    `loss.backward(); opt.step()`) from the same start. Checked for k = 1 too: a lone GPU still
    goes through gpulab's replicate/scatter/update path.

    In float64: the k-device step sums in a different order (per shard, then the allreduce),
    and on a small batch twenty BatchNorm layers amplify float32's last-bit differences to
    ~1e-4 relative, which would hide a real error. In float64 the two agree to ~1e-15.
    """
    k = len(devices)
    channels_last = devices[0].type == "cpu"
    sync_bn = any(isinstance(m, nn.BatchNorm2d) for m in _model(name, False).modules())
    X, y = _batch(max(cfg.parity_batch, k), devices[0], channels_last, seed=1)
    X = X.double()
    reference = _model(name, channels_last).double().to(devices[0])
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.CrossEntropyLoss()(reference(X), y).backward()
    opt.step()
    model = _model(name, channels_last).double()
    dp = DataParallel(model, devices, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), sync_bn=sync_bn)
    Trainer(dp, nn.CrossEntropyLoss()).train_step(X, y)
    what = f"{name}: one float64 step on {format_devices(devices)} == plain PyTorch on {devices[0]}"
    result.check(what, [p.detach() for p in dp.module.parameters()], [p.detach() for p in reference.parameters()],
                 rtol=1e-9, atol=1e-12)


def summarize(rows: list[dict]) -> dict:
    eff = {}
    for r in rows:
        if r["k"] > 1:
            eff[f"{r['model']} {r['mode']} k={r['k']} {r['devices']}"] = r["efficiency"]
    parts = []
    for model in dict.fromkeys(r["model"] for r in rows):
        sel = [r for r in rows if r["model"] == model and r["mode"] == "per-device batch"] or [r for r in rows if r["model"] == model]
        top = max(sel, key=lambda r: r["k"])
        parts.append(f"{model}: {top['samples_per_s']:,.0f} samples/s at k={top['k']} ({top['efficiency']:.0%} efficiency, {top['mode']})")
    return {"efficiency": eff, "headline": "; ".join(parts)}


def plot(result: Result):
    rows = result.tables["steps"].rows if "steps" in result.tables else []
    model_names = list(dict.fromkeys(r["model"] for r in rows)) or ["(none)"]
    fig, axes = figure(ncols=len(model_names), width=4.8)
    for ax, model in zip(axes, model_names):
        for mode, style in (("per-device batch", "-o"), ("global batch", "--s")):
            sel = [r for r in rows if r["model"] == model and r["mode"] == mode]
            if sel:
                ax.plot([r["k"] for r in sel], [r["samples_per_s"] for r in sel], style, ms=4, label=f"measured, {mode}")
        ideal = [r for r in rows if r["model"] == model and r["k"] == 1 and r["mode"] == "per-device batch"]
        # Virtual CPU replicas (cpu*k) share the same cores: k=1's rate is the reference, not k times it.
        virtual = all("cuda" not in str(r["devices"]) for r in rows if r["model"] == model)
        if ideal:
            ks = sorted({r["k"] for r in rows if r["model"] == model})
            one = ideal[0]["samples_per_s"]
            if virtual:
                ax.plot(ks, [one for _ in ks], ":", color="grey", label="k=1's rate: the same cores, no speed-up expected")
            else:
                ax.plot(ks, [one * k for k in ks], ":", color="grey", label="ideal (linear)")
        ax.set_xlabel("virtual CPU replicas k (cpu*k, one set of cores)" if virtual else "devices k")
        ax.set_ylabel("samples/s")
        ax.set_title(f"{model}: data-parallel throughput" + ("\non virtual replicas: correctness and overhead, not speed-up" if virtual else ""),
                     fontsize=9)
        ax.grid(alpha=0.3)
        if rows:
            ax.set_xticks(sorted({r["k"] for r in rows}))
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
