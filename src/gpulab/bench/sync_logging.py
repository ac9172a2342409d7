"""sync-logging: the chapter's logging exercise, 1000 matmuls of 100 x 100 with a norm logged per step.

Two ways to keep the log of tr(M M^T) (the squared Frobenius norm, computed as sum(M * M)):
- host read per step: `.item()` after every product, appended to a Python list. On a GPU each
  read waits for the device to finish everything queued so far, then the host launches the next
  product into an idle device: the GPU never runs ahead, and every launch latency is exposed.
- log on the device: each norm is written into a preallocated device tensor, and the whole log
  comes back with one transfer at the end. The host only launches work; the device stays busy.

On a CPU both are the same synchronous work, so the ratio is ~1: the lesson is a GPU lesson,
and the CPU row shows the baseline.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure

LESSON = (
    "Reading a value back every step makes the host wait for the device each time; "
    "keep the log on the device and read it once at the end."
)


@dataclass(kw_only=True)
class Config:
    steps: int = 1000
    """Matrix products per run (the chapter's 1000)."""
    n: int = 100
    """Matrix size (the chapter's 100 x 100)."""
    repeats: int = 7
    max_total_s: float = 10.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(repeats=5, max_total_s=2.0),
    "tiny": dict(steps=50, repeats=3, max_total_s=0.2),
}


def workload(cfg: Config, device: torch.device):
    """The two ways to log, over the same products X[i] @ W."""
    g = torch.Generator().manual_seed(0)
    # Scaled by 1/sqrt(n) so each product has entries of order 1 and the norms stay moderate.
    X = (torch.randn(cfg.steps, cfg.n, cfg.n, generator=g) / cfg.n**0.5).to(device)
    W = (torch.randn(cfg.n, cfg.n, generator=g) / cfg.n**0.5).to(device)

    def host_read_per_step() -> list[float]:
        log = []
        for i in range(cfg.steps):
            M = X[i] @ W
            log.append((M * M).sum().item())  # the host waits here, every step
        return log

    def log_on_device() -> list[float]:
        log = torch.empty(cfg.steps, device=device)
        for i in range(cfg.steps):
            M = X[i] @ W
            log[i] = (M * M).sum()  # a device-to-device write: nothing to wait for
        return log.tolist()  # one transfer for the whole log

    return host_read_per_step, log_on_device


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table(
        "runs",
        f"{cfg.steps} matmuls of {cfg.n}x{cfg.n}, logging tr(M M^T) each step",
        [
            Column("device", "device"),
            Column("log", "log kept"),
            Column("time", f"time per {cfg.steps} steps", "time"),
            Column("per_step_s", "per step", "seconds"),
            Column("ratio", "slower than device log", "ratio"),
        ],
    )
    devices = ctx.single_devices()
    if not ctx.gpus():
        result.skip("GPU rows", ctx.no_gpu_reason())
    ratios = {}
    for device in devices:
        ctx.progress(f"sync-logging on {device}")
        host_read, device_log = workload(cfg, device)
        # The same products in the same order on the same device: the logs must match (to float
        # precision, in case a GPU library picks another kernel for the same product).
        result.check(f"{device}: host-read log == device log", torch.tensor(host_read()), torch.tensor(device_log()), rtol=1e-6, atol=0)
        # wall+sync: the host-read variant synchronizes inside, so only the host clock around a
        # full synchronization compares the two fairly.
        timings = {
            name: measure(fn, [device], clock="wall+sync", repeats=cfg.repeats, min_sample_s=0, max_total_s=cfg.max_total_s)
            for name, fn in (("host read per step", host_read), ("on device, read once", device_log))
        }
        base = timings["on device, read once"].median_s
        for name, t in timings.items():
            table.add(device=str(device), log=name, time=t, per_step_s=t.median_s / cfg.steps, ratio=t.median_s / base)
        ratios[str(device)] = timings["host read per step"].median_s / base

    result.summary = {
        "host_read_slowdown": ratios,
        "headline": "; ".join(f"{d}: a host read per step takes {r:.2f}x the time of a device log" for d, r in ratios.items()),
    }


def plot(result: Result):
    fig, (ax,) = figure(width=6.5)
    rows = result.tables["runs"].rows if "runs" in result.tables else []
    devices = list(dict.fromkeys(r["device"] for r in rows))
    width = 0.38
    for j, name in enumerate(("host read per step", "on device, read once")):
        sel = {r["device"]: r for r in rows if r["log"] == name}
        xs = [i + (j - 0.5) * width for i in range(len(devices))]
        ys = [sel[d]["per_step_s"] * 1e6 for d in devices]
        bars = ax.bar(xs, ys, width, label=name)
        if j == 0:
            ax.bar_label(bars, [f"{sel[d]['ratio']:.2f}x" for d in devices], fontsize=8)
    ax.set_xticks(range(len(devices)), devices)
    ax.set_ylabel("µs per step (matmul + norm + log)")
    ax.set_title("logging a norm every step: host read vs device log")
    ax.grid(alpha=0.3, axis="y")
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
