"""matmul: the chapter's first exercise, "large vs small computations" on the CPU and the GPU.

C = A @ B for square n x n matrices, n = 16 ... 8192. A product costs 2n^3 floating-point
operations on 3n^2 numbers, so small products are dominated by fixed costs (a kernel launch,
a thread-pool wake-up) and large ones by arithmetic. The GPU's fixed cost is larger and its
arithmetic far faster, so there is a size below which the CPU wins: the crossover.

GPU rows run in fp32 (TF32 off: full-precision "highest"), TF32 (fp32 storage, tensor cores
with a 10-bit mantissa) and bf16. Each product is first compared with an fp64 reference on a
few rows, with a tolerance that matches the precision.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure
from gpulab.devices import cpu

LESSON = (
    "Small products are dominated by fixed costs and the CPU wins; large ones by arithmetic, "
    "where a GPU is orders of magnitude faster: measure where the crossover is."
)

# dtype name -> (storage dtype, float32 matmul precision, tolerance per sqrt(n) vs fp64)
# An entry of C sums n products of N(0,1) numbers: it is ~sqrt(n) in size, and so is its
# rounding error in units of the format's epsilon; hence the tolerance scales with sqrt(n).
DTYPES = {
    "fp32": (torch.float32, "highest", 1e-4),
    "tf32": (torch.float32, "high", 2e-2),
    "bf16": (torch.bfloat16, "highest", 6e-2),
}
REFERENCE_ROWS = 8  # rows of C checked against fp64: O(n^2) work, cheap even at n = 8192


@dataclass(kw_only=True)
class Config:
    sizes: list[int] = field(default_factory=lambda: [2**i for i in range(4, 14)])
    """n for n x n @ n x n, powers of 2."""
    gpu_dtypes: list[str] = field(default_factory=lambda: ["fp32", "tf32", "bf16"])
    cpu_max_product_s: float = 3.0
    """Skip CPU sizes whose single product would take longer than this (extrapolated as n^3 from
    the last size measured): on a 2-core CPU n = 8192 takes ~20 s a product."""
    repeats: int = 7
    min_sample_s: float = 0.05
    max_total_s: float = 8.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(
        sizes=[2**i for i in range(4, 11)], cpu_max_product_s=0.5, repeats=5, min_sample_s=0.01,
        max_total_s=1.0,
    ),
    "tiny": dict(sizes=[16, 32, 64], repeats=3, min_sample_s=0.001, max_total_s=0.2),
}


@contextmanager
def float32_precision(mode: str):
    """'highest' = true fp32 products; 'high' lets fp32 products use TF32 tensor cores."""
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(mode)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(old)


def run(cfg: Config, ctx, result: Result) -> None:
    times = result.table(
        "products",
        "C = A @ B, n x n (time per product, median ±half-IQR)",
        [
            Column("device", "device"),
            Column("dtype", "dtype"),
            Column("n", "n", "int"),
            Column("time", "time", "time"),
            Column("gflops", "GFLOP/s", "rate"),
        ],
    )
    devices = [cpu(), *ctx.gpus()]  # the CPU is always measured: it is the baseline
    if not ctx.gpus():
        result.skip("GPU rows (fp32, tf32, bf16)", ctx.no_gpu_reason())
    result.note("CPU rows are fp32, the CPU's training dtype; TF32 and bf16 rows are measured on GPUs (tensor cores)")

    for device in devices:
        for dtype in ["fp32"] if device.type == "cpu" else cfg.gpu_dtypes:
            last: tuple[int, float] | None = None
            for n in cfg.sizes:
                if device.type == "cpu" and last is not None:
                    predicted = last[1] * (n / last[0]) ** 3
                    if predicted > cfg.cpu_max_product_s:
                        larger = [m for m in cfg.sizes if m >= n]
                        result.skip(
                            f"cpu fp32 n = {', '.join(map(str, larger))}",
                            f"one product would take ~{predicted:.1f} s here (cap {cfg.cpu_max_product_s:g} s)",
                        )
                        break
                ctx.progress(f"matmul {device} {dtype} n={n}")
                t = _time_product(cfg, result, device, dtype, n)
                times.add(device=str(device), dtype=dtype, n=n, time=t, gflops=2 * n**3 / t.median_s / 1e9)
                last = (n, t.median_s)
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # 8192^2 x 3 buffers per dtype: do not hoard them

    result.summary = summarize(times.rows)


def _time_product(cfg: Config, result: Result, device: torch.device, dtype: str, n: int):
    storage, precision, tol = DTYPES[dtype]
    g = torch.Generator().manual_seed(n)
    a_host, b_host = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    a, b = a_host.to(device, storage), b_host.to(device, storage)
    c = torch.empty(n, n, device=device, dtype=storage)  # out=: no allocation inside the timing
    with float32_precision(precision):
        torch.mm(a, b, out=c)
        reference = a_host[:REFERENCE_ROWS].double() @ b_host.double()
        result.check(f"{device} {dtype} n={n} vs fp64", c[:REFERENCE_ROWS].float(), reference, rtol=0, atol=tol * math.sqrt(n))
        return measure(
            lambda: torch.mm(a, b, out=c),
            [device],
            repeats=cfg.repeats,
            min_sample_s=cfg.min_sample_s,
            max_total_s=cfg.max_total_s,
        )


def summarize(rows: list[dict]) -> dict:
    """Peak GFLOP/s per (device, dtype), and the size from which each GPU's fp32 beats the CPU."""
    peak: dict[str, dict] = {}
    for r in rows:
        key = f"{r['device']} {r['dtype']}"
        if key not in peak or r["gflops"] > peak[key]["gflops"]:
            peak[key] = {"gflops": r["gflops"], "n": r["n"]}
    cpu_time = {r["n"]: r["time"]["median_s"] for r in rows if r["device"] == "cpu"}
    crossover: dict[str, int | None] = {}
    for device in sorted({r["device"] for r in rows if r["device"] != "cpu"}):
        gpu_time = {r["n"]: r["time"]["median_s"] for r in rows if r["device"] == device and r["dtype"] == "fp32"}
        both = sorted(set(cpu_time) & set(gpu_time))
        # the smallest n from which the GPU is faster at every measured size
        winner = None
        for n in reversed(both):
            if gpu_time[n] >= cpu_time[n]:
                break
            winner = n
        crossover[device] = winner
    summary: dict = {"peak_gflops": peak, "gpu_fp32_faster_from_n": crossover}
    parts = []
    if "cpu fp32" in peak:
        parts.append(f"CPU fp32 peaks at {peak['cpu fp32']['gflops']:,.0f} GFLOP/s (n={peak['cpu fp32']['n']})")
    for device, n in crossover.items():
        best = max((v["gflops"], k) for k, v in peak.items() if k.startswith(device + " "))
        parts.append(
            f"{device} beats the CPU from n={n} and peaks at {best[0]:,.0f} GFLOP/s ({best[1].split()[-1]})"
            if n
            else f"{device} never beats the CPU at the sizes measured on both"
        )
    summary["headline"] = "; ".join(parts)
    return summary


def plot(result: Result):
    fig, (ax,) = figure()
    rows = result.tables["products"].rows if "products" in result.tables else []
    styles = {"fp32": "-o", "tf32": "--s", "bf16": ":^"}
    for key in dict.fromkeys((r["device"], r["dtype"]) for r in rows):
        sel = [r for r in rows if (r["device"], r["dtype"]) == key]
        ax.plot([r["n"] for r in sel], [r["gflops"] for r in sel], styles[key[1]], label=f"{key[0]} {key[1]}", ms=4)
    for device, n in result.summary.get("gpu_fp32_faster_from_n", {}).items():
        if n:
            ax.axvline(n, color="grey", ls=":", lw=1)
            # x in data units, y in axes units: the label sits at the bottom whatever the scale
            ax.text(n, 0.03, f" {device} fp32 wins from n={n}", rotation=90, fontsize=7, transform=ax.get_xaxis_transform())
    if rows:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
    ax.set_xlabel("n (C = A @ B, n x n)")
    ax.set_ylabel("GFLOP/s (2n^3 / time)")
    ax.set_title("matmul throughput vs size")
    ax.grid(alpha=0.3, which="both")
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
