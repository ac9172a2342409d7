"""concurrency: the chapter's last exercise, two matmul workloads at the same time vs one after another.

A workload is `reps` products C = A @ B of n x n matrices. Three set-ups, whichever exist here:
- two GPUs: workload 1 on cuda:0 and workload 2 on cuda:1, launched interleaved from one host
  thread (launches are asynchronous, so both GPUs compute at once) vs both on cuda:0 in turn.
  Two devices double the arithmetic units: expect close to 2x.
- one GPU, two CUDA streams: the workloads on separate streams vs both on one stream. Streams
  only help when one workload's kernels leave the GPU partly idle (small n); a large product
  fills the GPU alone, so two of them cannot overlap: expect ~1x there.
- virtual CPU replicas (cpu*2): two host threads, one workload each, vs one thread running
  both. The replicas are the same cores, and one product already uses every core through
  torch's thread pool: this shows the overhead, not a speedup.
Each concurrent run must give the same products as the sequential one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure
from gpulab.devices import cpu, format_devices

LESSON = (
    "Independent work on two devices runs at the same time: two GPUs give close to 2x; "
    "two streams on one GPU help only while one workload leaves it idle."
)


@dataclass(kw_only=True)
class Config:
    gpu_sizes: list[int] = field(default_factory=lambda: [256, 4096])
    """n on GPUs: a small product (launch-bound, leaves the GPU idle) and a large one (fills it)."""
    cpu_sizes: list[int] = field(default_factory=lambda: [128, 1024])
    reps: int = 20
    """Products per workload."""
    repeats: int = 7
    max_total_s: float = 8.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(gpu_sizes=[256, 2048], cpu_sizes=[64, 512], reps=8, repeats=5, max_total_s=1.0),
    "tiny": dict(gpu_sizes=[64], cpu_sizes=[32], reps=2, repeats=3, max_total_s=0.1),
}


def _inputs(n: int, devices: list[torch.device], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    host = [(torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)) for _ in devices]
    return [(a.to(d), b.to(d), torch.empty(n, n, device=d)) for (a, b), d in zip(host, devices)]


def setups(ctx) -> list[tuple[str, list[torch.device], list[torch.device]]]:
    """(mode, devices for the concurrent run, devices for the sequential run) for what exists here."""
    gpus = ctx.gpus()
    out = []
    if len(gpus) >= 2:
        out.append(("two devices", gpus[:2], [gpus[0], gpus[0]]))
    if gpus:
        out.append(("two streams", [gpus[0], gpus[0]], [gpus[0], gpus[0]]))
    cpu_listed = ctx.devices is None or any(d.type == "cpu" for d in ctx.devices)
    if cpu_listed:
        out.append(("two threads", [cpu(), cpu()], [cpu(), cpu()]))
    return out


def run(cfg: Config, ctx, result: Result) -> None:
    table = result.table(
        "runs",
        f"two workloads of {cfg.reps} products n x n: at the same time vs one after another",
        [
            Column("mode", "mode"),
            Column("devices", "devices"),
            Column("n", "n", "int"),
            Column("sequential", "one after another", "time"),
            Column("concurrent", "at the same time", "time"),
            Column("speedup", "speedup (ideal 2x)", "ratio"),
        ],
    )
    gpus = ctx.gpus()
    if not gpus:
        result.skip("two GPUs / two CUDA streams", ctx.no_gpu_reason())
    elif len(gpus) < 2:
        result.skip("two GPUs at once", f"needs 2 GPUs, found {len(gpus)} ({gpus[0]}): measured two streams instead")
    speedups = {}
    for mode, concurrent_devices, sequential_devices in setups(ctx):
        if mode == "two threads":
            result.note(
                "cpu*2 replicas are the same cores: one product already uses all of them, so two threads "
                "can only show the overhead of sharing, not a speedup"
            )
        for n in cfg.cpu_sizes if mode == "two threads" else cfg.gpu_sizes:
            ctx.progress(f"concurrency {mode} n={n}")
            seq_work = _inputs(n, sequential_devices)
            par_work = _inputs(n, concurrent_devices)
            sequential = _sequential(seq_work, cfg.reps)
            concurrent = {"two devices": _two_devices, "two streams": _two_streams, "two threads": _two_threads}[mode](
                par_work, cfg.reps
            )
            sequential()
            concurrent()
            result.check(
                f"{mode} n={n}: concurrent == sequential products",
                [c for _, _, c in par_work],
                [c for _, _, c in seq_work],
                # entries are ~sqrt(n): allow a different summation order (another stream, another
                # GPU's heuristics), not a different product
                rtol=1e-4,
                atol=1e-4 * n**0.5,
            )
            involved = [*set(concurrent_devices), *set(sequential_devices)]
            kw = dict(clock="wall+sync", repeats=cfg.repeats, min_sample_s=0.02, max_total_s=cfg.max_total_s)
            t_seq = measure(sequential, involved, **kw)
            t_par = measure(concurrent, involved, **kw)
            speedup = t_seq.median_s / t_par.median_s
            table.add(
                mode=mode, devices=format_devices(concurrent_devices), n=n, sequential=t_seq, concurrent=t_par, speedup=speedup
            )
            speedups[f"{mode} n={n}"] = speedup
            if concurrent_devices[0].type == "cuda":
                torch.cuda.empty_cache()

    result.summary = {
        "speedup": speedups,
        "headline": "; ".join(f"{k}: {v:.2f}x" for k, v in speedups.items()),
    }


def _sequential(work, reps: int):
    """Both workloads on the first device/stream/thread, one after the other."""

    def go():
        for a, b, c in work:
            for _ in range(reps):
                torch.mm(a, b, out=c)

    return go


def _two_devices(work, reps: int):
    """One host thread, launches interleaved: each launch returns at once, both GPUs run."""

    def go():
        for _ in range(reps):
            for a, b, c in work:
                torch.mm(a, b, out=c)

    return go


def _two_streams(work, reps: int):
    device = work[0][0].device
    streams = [torch.cuda.Stream(device) for _ in work]

    def go():
        main = torch.cuda.current_stream(device)
        for s in streams:
            s.wait_stream(main)  # inputs were written on the main stream
        for _ in range(reps):
            for (a, b, c), s in zip(work, streams):
                with torch.cuda.stream(s):
                    torch.mm(a, b, out=c)
        for s in streams:
            main.wait_stream(s)  # later work on the main stream sees the results

    return go


def _two_threads(work, reps: int):
    def one(a, b, c):
        for _ in range(reps):
            torch.mm(a, b, out=c)

    def go():
        threads = [threading.Thread(target=one, args=w) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    return go


def plot(result: Result):
    fig, (ax,) = figure(width=6.5)
    rows = result.tables["runs"].rows if "runs" in result.tables else []
    labels = [f"{r['mode']}\nn={r['n']}" for r in rows]
    bars = ax.bar(range(len(rows)), [r["speedup"] for r in rows], color="tab:blue")
    ax.bar_label(bars, [f"{r['speedup']:.2f}x" for r in rows], fontsize=8)
    ax.axhline(2.0, color="tab:green", ls="--", lw=1, label="ideal (2 devices)")
    ax.axhline(1.0, color="grey", ls=":", lw=1, label="no gain")
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("speedup: sequential time / concurrent time")
    ax.set_title("two workloads at the same time")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
