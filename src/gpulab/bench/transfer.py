"""transfer: what moving data costs, host <-> device and on one device.

Host <-> GPU copies by size, in four ways:
- pageable, blocking: `x.to(device)` from ordinary memory. The driver first copies into a
  pinned staging buffer, then DMAs it; the host waits for all of it.
- pageable, non_blocking: the same, because the staging copy is done by the host anyway:
  `non_blocking=True` buys nothing without pinned memory.
- pinned, blocking: page-locked memory is DMA'd directly: higher bandwidth.
- pinned, non_blocking: same bandwidth, but the call returns at once, so the host can queue
  compute that overlaps with the copy. The "host blocked" column shows that difference.
Each copy goes into a preallocated destination (`dst.copy_(src)`): allocating pinned memory
is itself slow and would be charged to the copy.

On one device: `copy_to(x, d)` always makes a new copy (memory bandwidth), while `place(x, d)`
returns `x` itself when it already lives on `d` (a few microseconds of Python, at any size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gpulab.bench.harness import measure
from gpulab.devices import synchronize
from gpulab.bench.result import Column, Result, figure, fmt_bytes, fmt_seconds
from gpulab.devices import copy_to, place

LESSON = (
    "Copies between host and device are slow next to compute; pinned memory is faster and lets "
    "non_blocking copies overlap; moving data to where it already lives should cost nothing."
)

MODES = (("pageable", False), ("pageable", True), ("pinned", False), ("pinned", True))


@dataclass(kw_only=True)
class Config:
    sizes: list[int] = field(default_factory=lambda: [4**i * 1024 for i in range(0, 10)])
    """Bytes per copy: 1 KiB ... 256 MiB, powers of 4."""
    repeats: int = 7
    min_sample_s: float = 0.02
    max_total_s: float = 3.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(sizes=[4**i * 1024 for i in range(0, 7)], repeats=5, min_sample_s=0.005, max_total_s=0.3),
    "tiny": dict(sizes=[1024, 64 * 1024], repeats=3, min_sample_s=0.001, max_total_s=0.05),
}


def run(cfg: Config, ctx, result: Result) -> None:
    host = result.table(
        "host_device",
        "host <-> device copies into a preallocated buffer",
        [
            Column("device", "device"),
            Column("direction", "direction"),
            Column("memory", "host memory"),
            Column("non_blocking", "non_blocking"),
            Column("bytes", "size", "bytes"),
            Column("time", "time", "time"),
            Column("gbps", "GB/s", "num"),
            Column("host_blocked_s", "host blocked", "seconds"),
        ],
    )
    same = result.table(
        "same_device",
        "same device: copy_to (always copies) vs place (no-op when already there)",
        [
            Column("device", "device"),
            Column("bytes", "size", "bytes"),
            Column("copy_to", "copy_to", "time"),
            Column("copy_gbps", "copy GB/s", "num"),
            Column("place", "place", "time"),
            Column("ratio", "copy / place", "ratio"),
        ],
    )
    gpus = ctx.gpus()
    if not gpus:
        result.skip("host <-> GPU copies (pageable/pinned, blocking/non_blocking)", ctx.no_gpu_reason())
    kw = dict(repeats=cfg.repeats, min_sample_s=cfg.min_sample_s, max_total_s=cfg.max_total_s)

    for device in gpus:
        for nbytes in cfg.sizes:
            for direction in ("host->device", "device->host"):
                for memory, non_blocking in MODES:
                    ctx.progress(f"transfer {device} {direction} {memory} {nbytes} B")
                    src, dst = _buffers(nbytes, device, direction, pinned=memory == "pinned")
                    copy = lambda: dst.copy_(src, non_blocking=non_blocking)  # noqa: E731
                    copy()
                    synchronize([device])
                    result.check(f"{device} {direction} {memory} nb={non_blocking} {nbytes} B", dst, src, rtol=0, atol=0)
                    # wall+sync: the time until the data has arrived, as a user waits for it
                    t = measure(copy, [device], clock="wall+sync", **kw)
                    host.add(
                        device=str(device),
                        direction=direction,
                        memory=memory,
                        non_blocking=non_blocking,
                        bytes=nbytes,
                        time=t,
                        gbps=nbytes / t.median_s / 1e9,
                        host_blocked_s=_host_blocked(copy, device),
                    )
        torch.cuda.empty_cache()

    for device in ctx.single_devices():
        for nbytes in cfg.sizes:
            ctx.progress(f"transfer {device} copy_to vs place {nbytes} B")
            x = _values(nbytes, device)
            assert place(x, device) is x  # the no-op really is one: same object, no memory
            result.check(f"{device} copy_to == x ({nbytes} B)", copy_to(x, device), x, rtol=0, atol=0)
            # wall+sync for both: place does no device work, so what it costs is host time
            t_copy = measure(lambda: copy_to(x, device), [device], clock="wall+sync", **kw)
            t_place = measure(lambda: place(x, device), [device], clock="wall+sync", **kw)
            same.add(
                device=str(device),
                bytes=nbytes,
                copy_to=t_copy,
                # a copy reads and writes every byte: report the bytes moved through memory
                copy_gbps=2 * nbytes / t_copy.median_s / 1e9,
                place=t_place,
                ratio=t_copy.median_s / t_place.median_s,
            )
    result.note("copy GB/s counts bytes read + written (2x the size); host<->device GB/s counts the size")
    result.summary = summarize(host.rows, same.rows)


def _values(nbytes: int, device: torch.device | None = None) -> torch.Tensor:
    # arange, not randn: generating 64M normal numbers takes longer than the copies measured
    return torch.arange(nbytes // 4, dtype=torch.float32, device=device)


def _buffers(nbytes: int, device: torch.device, direction: str, pinned: bool):
    host = _values(nbytes)
    if pinned:
        host = host.pin_memory()
    gpu = torch.empty(nbytes // 4, device=device)
    if direction == "host->device":
        return host, gpu
    gpu.copy_(host)
    return gpu, torch.empty(host.shape, dtype=host.dtype, pin_memory=pinned)


def _host_blocked(copy, device: torch.device, repeats: int = 5) -> float:
    """How long the host is stuck in the call itself (median): near zero when the copy is queued."""
    samples = []
    for _ in range(repeats):
        synchronize([device])
        t0 = time.perf_counter()
        copy()
        samples.append(time.perf_counter() - t0)
    synchronize([device])
    return sorted(samples)[len(samples) // 2]


def summarize(host_rows: list[dict], same_rows: list[dict]) -> dict:
    summary: dict = {}
    parts = []
    for r in host_rows:
        key = f"{r['device']} {r['direction']} {r['memory']}{' non_blocking' if r['non_blocking'] else ''}"
        summary.setdefault("peak_gbps", {})
        summary["peak_gbps"][key] = max(summary["peak_gbps"].get(key, 0.0), r["gbps"])
    if "peak_gbps" in summary:
        peaks = summary["peak_gbps"]
        for key in peaks:
            if key.endswith("host->device pinned"):
                device = key.split()[0]
                pageable = peaks.get(f"{device} host->device pageable", 0.0)
                parts.append(f"{device} H2D peaks at {peaks[key]:.1f} GB/s pinned vs {pageable:.1f} GB/s pageable")
    if same_rows:
        largest = max(r["bytes"] for r in same_rows)
        for r in same_rows:
            if r["bytes"] == largest:
                summary.setdefault("copy_vs_place_at_largest", {})[r["device"]] = r["ratio"]
                parts.append(
                    f"{r['device']}: copy_to of {fmt_bytes(largest)} takes {fmt_seconds(r['copy_to']['median_s'])}, "
                    f"place {fmt_seconds(r['place']['median_s'])}"
                )
    summary["headline"] = "; ".join(parts)
    return summary


def plot(result: Result):
    rows = result.tables["host_device"].rows if "host_device" in result.tables else []
    if not rows:  # no GPU: one panel, and the title says why the other is missing
        fig, (ax_same,) = figure(ncols=1, width=6)
        _plot_same_device(ax_same, result)
        skipped = "; ".join(s["why"] for s in result.skipped) or "no GPU"
        ax_same.set_title(f"same device: copy_to vs place\n(no host <-> GPU copies measured: {skipped})", fontsize=8, wrap=True)
        fig.tight_layout()
        return fig
    fig, (ax_host, ax_same) = figure(ncols=2, width=5.5)
    styles = {"host->device": "-", "device->host": "--"}
    markers = {("pageable", False): "o", ("pageable", True): "x", ("pinned", False): "s", ("pinned", True): "^"}
    for key in dict.fromkeys((r["device"], r["direction"], r["memory"], r["non_blocking"]) for r in rows):
        sel = [r for r in rows if (r["device"], r["direction"], r["memory"], r["non_blocking"]) == key]
        label = f"{key[0]} {key[1]} {key[2]}{' nb' if key[3] else ''}"
        ax_host.plot([r["bytes"] for r in sel], [r["gbps"] for r in sel], styles[key[1]], marker=markers[key[2:]], ms=3, label=label)
    ax_host.set_xscale("log", base=2)
    ax_host.set_yscale("log")
    ax_host.legend(fontsize=6)
    ax_host.set_xlabel("bytes per copy")
    ax_host.set_ylabel("GB/s")
    ax_host.set_title("host <-> device bandwidth")
    ax_host.grid(alpha=0.3, which="both")
    _plot_same_device(ax_same, result)
    ax_same.set_title("same device: copy_to vs place")
    fig.tight_layout()
    return fig


def _plot_same_device(ax_same, result: Result) -> None:
    same = result.tables["same_device"].rows if "same_device" in result.tables else []
    for device in dict.fromkeys(r["device"] for r in same):
        sel = [r for r in same if r["device"] == device]
        ax_same.plot([r["bytes"] for r in sel], [r["copy_to"]["median_s"] for r in sel], "-o", ms=3, label=f"{device} copy_to")
        ax_same.plot([r["bytes"] for r in sel], [r["place"]["median_s"] for r in sel], "--s", ms=3, label=f"{device} place")
    if same:
        ax_same.set_xscale("log", base=2)
        ax_same.set_yscale("log")
        ax_same.legend(fontsize=7)
    ax_same.set_xlabel("bytes")
    ax_same.set_ylabel("seconds per call")
    ax_same.grid(alpha=0.3, which="both")
