"""input-pipeline: the same training step, fed two ways.

(a) the classic pipeline: a per-sample `Dataset` (`gpulab.data.ImageDataset`: index one image,
    convert it to float, divide by 255) batched by `torch.utils.data.DataLoader` with 0, 2 or 4
    worker processes, pin_memory off/on, then copied to the device (`HostLoader`, non_blocking);
(b) gpulab's `DeviceLoader`: the dataset lives on the device as one uint8 tensor; a batch is
    a device-side gather plus one fused multiply-add. No per-sample Python, no copy per step.

Both feed LeNet's forward/backward/SGD step over the same samples in the same (shuffled)
order, and the batches are checked equal first. The device's waiting share is measured
against the step alone on batches already on the device:
    device waits = 1 - (time of the steps alone) / (time of the steps with their feeding)
Worker processes are persistent (started once, as a training run would keep them across
epochs with persistent_workers=True), so a pass measures steady state, not start-up.
On a CPU the "device" is the same cores the loader runs on: loading and computing compete.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from gpulab import data, models
from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure
from gpulab.errors import UserError

LESSON = (
    "A per-sample Python pipeline starves a fast device; workers and pinned memory help, "
    "a dataset resident on the device removes the wait."
)


@dataclass(kw_only=True)
class Config:
    batch: int = 256
    batches: int = 40
    """Batches per timed pass (a slice of an epoch; steady state is reached within a few)."""
    workers: list[int] = field(default_factory=lambda: [0, 2, 4])
    pin_memory: list[bool] = field(default_factory=lambda: [False, True])
    repeats: int = 3
    max_total_s: float = 20.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(batch=128, batches=8, workers=[0, 2], repeats=2, max_total_s=1.0),
    "tiny": dict(batch=16, batches=2, workers=[0, 2], repeats=1, max_total_s=0.1),
}


def dataset(num_samples: int) -> tuple[data.Split, str]:
    """The first `num_samples` Fashion-MNIST training images, or random ones of the same shape."""
    try:
        train, _ = data.load()
        return data.Split(train.images[:num_samples], train.labels[:num_samples]), f"fashion-mnist (first {num_samples})"
    except UserError:
        # Loading speed does not depend on pixel values: same shape and dtype suffice.
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (num_samples, 1, 28, 28), dtype=torch.uint8, generator=g)
        return data.Split(images, torch.randint(0, 10, (num_samples,), generator=g)), "synthetic (Fashion-MNIST not found)"


class Step:
    """LeNet forward/backward/SGD update on `device`: the work every feed has to keep busy."""

    def __init__(self, device: torch.device, channels_last: bool):
        torch.manual_seed(0)
        self.model = models.build("lenet").to(device)
        if channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.loss_fn = nn.CrossEntropyLoss()

    def __call__(self, X: torch.Tensor, y: torch.Tensor) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.loss_fn(self.model(X), y).backward()
        self.opt.step()


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table(
        "feeds",
        f"LeNet training steps, batch {cfg.batch}, {cfg.batches} batches per pass",
        [
            Column("device", "device"),
            Column("feed", "feed"),
            Column("workers", "workers", "int"),
            Column("pin_memory", "pin_memory"),
            Column("time", "time per pass", "time"),
            Column("samples_per_s", "samples/s", "rate"),
            Column("device_wait", "device waits", "pct"),
            Column("vs_device_loader", "vs device-resident", "ratio"),
        ],
    )
    split, source = dataset(cfg.batch * cfg.batches)
    result.config["dataset"] = source
    if not ctx.gpus():
        result.skip("GPU rows", ctx.no_gpu_reason())
        if True in cfg.pin_memory:
            result.skip("pin_memory=True rows", "pinned host memory exists for DMA to a GPU; without CUDA there is nothing to pin for")
    kw = dict(clock="wall+sync", warmup=1, repeats=cfg.repeats, min_sample_s=0, max_total_s=cfg.max_total_s)
    waits = {}
    for device in ctx.single_devices():
        channels_last = device.type == "cpu"  # as the trainer does: oneDNN convolutions prefer NHWC
        step = Step(device, channels_last)
        resident = data.DeviceLoader(split, cfg.batch, device, shuffle=True, normalize=False, channels_last=channels_last)
        order = resident.batches.order().tolist()  # the classic pipeline visits the samples in this same order
        reference = list(resident)

        ctx.progress(f"input-pipeline {device}: the step alone")
        t_compute = measure(lambda: [step(X, y) for X, y in reference], [device], **kw)

        ctx.progress(f"input-pipeline {device}: DeviceLoader")
        t_resident = measure(lambda: [step(X, y) for X, y in resident], [device], **kw)
        rows = [("device-resident (DeviceLoader)", None, None, t_resident)]

        for workers in cfg.workers:
            for pin in cfg.pin_memory:
                if pin and device.type != "cuda":
                    continue
                ctx.progress(f"input-pipeline {device}: DataLoader workers={workers} pin_memory={pin}")
                with warnings.catch_warnings():
                    # DataLoader warns when workers outnumber the cores; said once, as a note, below
                    warnings.filterwarnings("ignore", message=".*worker processes in total.*")
                    loader = DataLoader(
                        data.ImageDataset(split), batch_size=cfg.batch, sampler=order, num_workers=workers,
                        pin_memory=pin, persistent_workers=workers > 0,
                    )
                    feed = data.HostLoader(loader, device, channels_last=channels_last)
                    got = list(feed)
                    result.check(
                        f"{device} DataLoader(workers={workers}, pin={pin}) batches == DeviceLoader batches",
                        [b for X, y in got for b in (X, y)],
                        [b for X, y in reference for b in (X, y)],
                        rtol=0,
                        atol=1e-6,  # x / 255 vs x * (1/255): one rounding apart
                    )
                    t = measure(lambda: [step(X, y) for X, y in feed], [device], **kw)
                rows.append(("DataLoader + per-sample Dataset", workers, pin, t))
                del feed, loader  # shuts persistent workers down before the next configuration

        for feed_name, workers, pin, t in rows:
            table.add(
                device=str(device), feed=feed_name, workers=workers, pin_memory=pin, time=t,
                samples_per_s=cfg.batch * cfg.batches / t.median_s,
                device_wait=max(0.0, 1 - t_compute.median_s / t.median_s),
                vs_device_loader=t.median_s / t_resident.median_s,
            )
        table.add(
            device=str(device), feed="(the step alone, batches already on the device)", time=t_compute,
            samples_per_s=cfg.batch * cfg.batches / t_compute.median_s, device_wait=0.0,
            vs_device_loader=t_compute.median_s / t_resident.median_s,
        )
        classic = [r for r in table.rows if r["device"] == str(device) and r["feed"].startswith("DataLoader")]
        waits[str(device)] = {
            "device_loader": max(0.0, 1 - t_compute.median_s / t_resident.median_s),
            "dataloader_best": min(r["device_wait"] for r in classic) if classic else None,
            "dataloader_worst": max(r["device_wait"] for r in classic) if classic else None,
        }
    result.note("DataLoader workers are persistent: each pass is steady state (worker start-up is not timed)")
    cores = os.cpu_count() or 1
    if max(cfg.workers) > cores:
        result.note(f"{max(cfg.workers)} workers on {cores} cores: the workers and the training step compete for the cores")
    result.summary = {
        "device_wait": waits,
        "headline": "; ".join(
            f"{d}: the device waits {w['dataloader_best']:.0%}-{w['dataloader_worst']:.0%} of the time with "
            f"DataLoader, {w['device_loader']:.0%} with DeviceLoader"
            for d, w in waits.items()
            if w["dataloader_best"] is not None
        ),
    }


def plot(result: Result):
    fig, (ax,) = figure(width=7.5, height=4.2)
    rows = [r for r in (result.tables["feeds"].rows if "feeds" in result.tables else []) if not r["feed"].startswith("(")]
    labels = []
    for r in rows:
        if r["workers"] is None:
            labels.append(f"{r['device']}\nDeviceLoader")
        else:
            labels.append(f"{r['device']}\nw={r['workers']}{' pin' if r['pin_memory'] else ''}")
    colors = ["tab:green" if r["workers"] is None else "tab:blue" for r in rows]
    bars = ax.bar(range(len(rows)), [r["samples_per_s"] for r in rows], color=colors)
    ax.bar_label(bars, [f"waits {r['device_wait']:.0%}" for r in rows], fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    values = [r["samples_per_s"] for r in rows]
    if values and max(values) > 20 * min(values):  # CPU and GPU rows together: a log axis keeps both readable
        ax.set_yscale("log")
    ax.set_ylabel("samples/s (LeNet training)")
    ax.set_title("input pipeline: DataLoader (blue) vs device-resident (green)")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
