"""allreduce: gpulab's algorithms (and NCCL, gloo) x message size x number of devices k.

For each k, algorithm and message size S (bytes per device), one float32 tensor of S bytes
per device is summed in place. Reported, as nccl-tests does:
    algbw = S / time                      what the caller sees
    busbw = algbw * 2(k-1)/k              the traffic each device's link actually carries in an
                                          optimal ring: comparable across k, and to the link's
                                          peak bandwidth
Algorithms:
  naive   everything added into device 0, the sum copied back (gpulab.parallel)
  ring    reduce-scatter + all-gather in k-1 steps each (gpulab.parallel)
  nccl    NVIDIA's library via torch.cuda.nccl: GPUs only, one tensor per GPU
  gloo    torch.distributed's CPU backend with k real ranks: here k threads of this process,
          each its own process group, connected over loopback TCP, so the data really
          travels between ranks as in multi-process CPU training on one machine (a
          world_size=1 group would measure nothing). CPU tensors only.
  bucketed  a model's gradients summed tensor by tensor vs through `Buckets` (a few flat
          buffers): the same bytes, far fewer calls.

Before timing, each algorithm sums small integers (exact in float32) and must give exactly
the reference sum; the timed runs then sum zeros, whose cost is the same but whose values
cannot grow to inf over hundreds of repeats.
"""

from __future__ import annotations

import datetime
import threading
from dataclasses import dataclass, field

import torch

from gpulab import models
from gpulab.bench.harness import measure
from gpulab.bench.result import Column, Result, figure
from gpulab.devices import cpu, format_devices
from gpulab.parallel import Buckets, allreduce
from gpulab.parallel.allreduce import nccl_usable

LESSON = (
    "A ring keeps every link busy and sends 2(k-1)/k of the data per device whatever k is; "
    "one large message is far cheaper than many small ones (buckets)."
)


@dataclass(kw_only=True)
class Config:
    sizes: list[int] = field(default_factory=lambda: [4**i * 1024 for i in range(0, 10)])
    """Bytes per device: 1 KiB ... 256 MiB, powers of 4."""
    cpu_replicas: int = 4
    """Virtual CPU replicas without --devices: k = 2 and 4 on cpu*4."""
    bucket_models: list[str] = field(default_factory=lambda: ["lenet", "resnet18"])
    gloo: bool = True
    repeats: int = 7
    min_sample_s: float = 0.02
    max_total_s: float = 2.0


PRESETS = {  # `--preset NAME`: the sizes of each run; "full" is Config's defaults
    "full": {},
    "quick": dict(
        sizes=[4**i * 1024 for i in range(0, 6)], bucket_models=["lenet"], repeats=5, min_sample_s=0.005,
        max_total_s=0.2,
    ),
    "tiny": dict(
        sizes=[1024, 64 * 1024], cpu_replicas=2, bucket_models=["lenet"], repeats=3, min_sample_s=0.001,
        max_total_s=0.05,
    ),
}


def ks_for(n: int) -> list[int]:
    """k = 2, 4, 8, ... up to n, and n itself."""
    ks = [k for k in (2, 4, 8, 16, 32) if k <= n]
    return ks + ([n] if n >= 2 and n not in ks else [])


def device_sets(cfg: Config, ctx) -> list[list[torch.device]]:
    """The pools to measure: virtual CPU replicas and/or the GPUs, from --devices or the defaults."""
    pools = []
    if ctx.devices is None:
        pools.append([cpu()] * cfg.cpu_replicas)
    else:
        cpus = [d for d in ctx.devices if d.type == "cpu"]
        if cpus:
            # 'cpu*K' gives K replicas; a plain 'cpu' is one device, and one device has nothing to
            # reduce, so it stands for the default number of virtual replicas.
            pools.append(cpus if len(cpus) > 1 else [cpu()] * cfg.cpu_replicas)
    gpus = ctx.gpus()
    if len(gpus) >= 2:
        pools.append(gpus)
    return pools


def run(cfg: Config, ctx, result: Result) -> None:
    sweep = result.table(
        "sweep",
        "allreduce of one float32 tensor per device (time per call; busbw = algbw x 2(k-1)/k)",
        [
            Column("devices", "devices"),
            Column("k", "k", "int"),
            Column("algorithm", "algorithm"),
            Column("bytes", "size", "bytes"),
            Column("time", "time", "time"),
            Column("algbw_gbps", "algbw GB/s", "num"),
            Column("busbw_gbps", "busbw GB/s", "num"),
        ],
    )
    buckets = result.table(
        "bucketed",
        "a model's gradients: one allreduce per tensor vs bucketed into flat buffers",
        [
            Column("devices", "devices"),
            Column("k", "k", "int"),
            Column("model", "model"),
            Column("tensors", "tensors", "int"),
            Column("bytes", "size", "bytes"),
            Column("algorithm", "algorithm"),
            Column("per_tensor", "per tensor", "time"),
            Column("bucketed", "bucketed", "time"),
            Column("speedup", "speedup", "ratio"),
        ],
    )
    gpus = ctx.gpus()
    if not gpus:
        result.skip("GPU rows (naive, ring, nccl across GPUs)", ctx.no_gpu_reason())
    elif len(gpus) < 2:
        result.skip("GPU rows (naive, ring, nccl across GPUs)", f"an allreduce needs 2+ GPUs; found 1 ({gpus[0]})")

    for pool in device_sets(cfg, ctx):
        virtual = len(set(pool)) == 1
        if virtual:
            result.note(
                f"{format_devices(pool)} are virtual replicas: one memory and the same cores, so naive/ring "
                "measure in-memory adds and copies (algorithm overhead), not link bandwidth"
            )
        for k in ks_for(len(pool)):
            devices = pool[:k]
            algorithms = ["naive", "ring"]
            if devices[0].type == "cuda":
                probe = [torch.empty(1, device=d) for d in devices]
                if nccl_usable(probe):
                    algorithms.append("nccl")
                else:
                    result.skip(f"nccl on {format_devices(devices)}", "torch.cuda.nccl is not available in this build")
            gloo = _gloo_ranks(k, result) if cfg.gloo and virtual else None
            for nbytes in cfg.sizes:
                for algorithm in algorithms:
                    ctx.progress(f"allreduce {algorithm} k={k} {nbytes} B")
                    t = _time_algorithm(cfg, result, devices, algorithm, nbytes)
                    _add_sweep_row(sweep, devices, algorithm, nbytes, t)
                if gloo is not None:
                    ctx.progress(f"allreduce gloo k={k} {nbytes} B")
                    t = gloo.time(cfg, result, nbytes)
                    _add_sweep_row(sweep, devices, "gloo", nbytes, t)
            if gloo is not None:
                gloo.close()
            for model in cfg.bucket_models:
                for algorithm in algorithms:
                    ctx.progress(f"allreduce bucketed {model} {algorithm} k={k}")
                    _bucketed_row(cfg, result, buckets, devices, model, algorithm)
            if devices[0].type == "cuda":
                torch.cuda.empty_cache()
    if cfg.gloo:
        result.note(
            "gloo: k ranks as threads of one process over loopback TCP, the library and transport of "
            "multi-process CPU training on one machine; each call also passes two thread barriers (tens of µs)"
        )
    result.summary = summarize(sweep.rows, buckets.rows)


def _add_sweep_row(table, devices, algorithm: str, nbytes: int, t) -> None:
    k = len(devices)
    algbw = nbytes / t.median_s / 1e9
    table.add(
        devices=format_devices(devices), k=k, algorithm=algorithm, bytes=nbytes, time=t,
        algbw_gbps=algbw, busbw_gbps=algbw * 2 * (k - 1) / k,
    )


def _pattern(numel: int, rank: int, device: torch.device) -> torch.Tensor:
    """Small integers, different per rank: their sums are exact in float32, in any order."""
    return ((torch.arange(numel, device=device) + 3 * rank) % 7 - 3).float()


def _time_algorithm(cfg: Config, result: Result, devices, algorithm: str, nbytes: int):
    numel = nbytes // 4
    tensors = [_pattern(numel, r, d) for r, d in enumerate(devices)]
    expected = sum(t.cpu() for t in tensors)
    allreduce(tensors, algorithm)
    result.check(f"{algorithm} k={len(devices)} {nbytes} B == sum", tensors, [expected] * len(tensors), rtol=0, atol=0)
    for t in tensors:
        t.zero_()
    return measure(
        lambda: allreduce(tensors, algorithm),
        devices,
        repeats=cfg.repeats,
        min_sample_s=cfg.min_sample_s,
        max_total_s=cfg.max_total_s,
    )


def _bucketed_row(cfg: Config, result: Result, table, devices, model: str, algorithm: str) -> None:
    k = len(devices)
    torch.manual_seed(0)
    replicas = [models.build(model).to(d) for d in devices]
    params = [list(r.parameters()) for r in replicas]
    # Per tensor: each gradient its own tensor, one allreduce call each (what a loop over
    # parameters does). Bucketed: gradients are views into a few flat buffers (gpulab's Buckets).
    loose = [[_pattern(p.numel(), r, p.device).view_as(p) for p in ps] for r, ps in enumerate(params)]
    flat = Buckets(params)
    for r, ps in enumerate(params):
        for p, g in zip(ps, loose[r]):
            p.grad.copy_(g)
    for i in range(len(params[0])):
        allreduce([loose[r][i] for r in range(k)], algorithm)
    flat.allreduce(algorithm)
    result.check(
        f"bucketed {model} {algorithm} k={k} == per tensor",
        [p.grad for ps in params for p in ps],
        [g for gs in loose for g in gs],
        rtol=0,
        atol=0,
    )
    for gs in loose:
        for g in gs:
            g.zero_()
    flat.zero_()

    def per_tensor():
        for i in range(len(loose[0])):
            allreduce([loose[r][i] for r in range(k)], algorithm)

    kw = dict(repeats=cfg.repeats, min_sample_s=cfg.min_sample_s, max_total_s=cfg.max_total_s)
    t_loose = measure(per_tensor, devices, **kw)
    t_flat = measure(lambda: flat.allreduce(algorithm), devices, **kw)
    table.add(
        devices=format_devices(devices), k=k, model=model, tensors=len(params[0]),
        bytes=sum(p.numel() * p.element_size() for p in params[0]), algorithm=algorithm,
        per_tensor=t_loose, bucketed=t_flat, speedup=t_loose.median_s / t_flat.median_s,
    )


# ----------------------------------------------------------------------------- gloo in threads


class _GlooRanks:
    """k gloo process groups in k threads of this process; rank 0 is the calling thread.

    Each call passes two barriers: one so that all k ranks enter the same collective, one so
    that the call returns only when every rank's tensor holds the sum.
    """

    def __init__(self, k: int, timeout_s: float = 120.0):
        import torch.distributed as dist

        self.k = k
        store = dist.HashStore()
        timeout = datetime.timedelta(seconds=timeout_s)
        self.groups: list = [None] * k
        errors: list[BaseException] = []

        def create(rank: int) -> None:
            try:
                self.groups[rank] = _gloo_group(dist, store, rank, k, timeout)
            except BaseException as e:  # reported by the caller as a skipped row
                errors.append(e)

        # Creating a group is itself collective (the ranks meet through the store): in parallel.
        threads = [threading.Thread(target=create, args=(r,), daemon=True) for r in range(k)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout_s)
        if errors or any(g is None for g in self.groups):
            raise RuntimeError(f"could not create {k} gloo ranks: {errors[0] if errors else 'timed out'}")
        self.start = threading.Barrier(k, timeout=timeout_s)
        self.done = threading.Barrier(k, timeout=timeout_s)
        self.tensors: list[torch.Tensor] = []
        self.stop = False
        self.workers = [threading.Thread(target=self._worker, args=(r,), daemon=True) for r in range(1, k)]
        for w in self.workers:
            w.start()

    def _worker(self, rank: int) -> None:
        while True:
            self.start.wait()
            if self.stop:
                return
            self.groups[rank].allreduce([self.tensors[rank]]).wait()
            self.done.wait()

    def allreduce_once(self) -> None:
        self.start.wait()
        self.groups[0].allreduce([self.tensors[0]]).wait()
        self.done.wait()

    def time(self, cfg: Config, result: Result, nbytes: int):
        numel = nbytes // 4
        self.tensors = [_pattern(numel, r, cpu()) for r in range(self.k)]
        expected = sum(t.clone() for t in self.tensors)
        self.allreduce_once()
        result.check(f"gloo k={self.k} {nbytes} B == sum", self.tensors, [expected] * self.k, rtol=0, atol=0)
        for t in self.tensors:
            t.zero_()
        return measure(
            self.allreduce_once, [cpu()], repeats=cfg.repeats, min_sample_s=cfg.min_sample_s, max_total_s=cfg.max_total_s
        )

    def close(self) -> None:
        self.stop = True
        self.start.wait()
        for w in self.workers:
            w.join()


def _gloo_group(dist, store, rank: int, k: int, timeout: datetime.timedelta):
    # Bind to loopback explicitly: the default device resolves the host name, which on a
    # machine without network may not resolve at all.
    options_type = getattr(dist.ProcessGroupGloo, "_Options", None)
    if options_type is not None and hasattr(dist.ProcessGroupGloo, "create_device"):
        opts = options_type()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        opts._timeout = timeout
        return dist.ProcessGroupGloo(store, rank, k, opts)
    return dist.ProcessGroupGloo(store, rank, k, timeout)


def _gloo_ranks(k: int, result: Result) -> _GlooRanks | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_gloo_available()):
        result.skip("gloo rows", "this torch build has no torch.distributed gloo backend")
        return None
    try:
        return _GlooRanks(k)
    except RuntimeError as e:
        result.skip(f"gloo rows k={k}", str(e))
        return None


# ----------------------------------------------------------------------------- summary and plot


def summarize(sweep: list[dict], bucketed: list[dict]) -> dict:
    best: dict[str, dict] = {}
    for r in sweep:
        key = f"{r['devices']} {r['algorithm']}"
        if key not in best or r["busbw_gbps"] > best[key]["busbw_gbps"]:
            best[key] = {"busbw_gbps": r["busbw_gbps"], "bytes": r["bytes"], "k": r["k"]}
    speedups = {f"{r['devices']} {r['model']} {r['algorithm']}": r["speedup"] for r in bucketed}
    parts = [f"{key}: {v['busbw_gbps']:.1f} GB/s busbw at best" for key, v in best.items()]
    if speedups:
        top = max(speedups, key=speedups.get)
        parts.append(f"buckets up to {speedups[top]:.1f}x faster than per-tensor ({top})")
    return {"peak_busbw_gbps": best, "bucketed_speedup": speedups, "headline": "; ".join(parts)}


def plot(result: Result):
    fig, (ax_sweep, ax_buckets) = figure(ncols=2, width=5.8)
    rows = result.tables["sweep"].rows if "sweep" in result.tables else []
    styles = {"naive": "-o", "ring": "-s", "nccl": "-^", "gloo": "--x"}
    for key in dict.fromkeys((r["devices"], r["algorithm"]) for r in rows):
        sel = [r for r in rows if (r["devices"], r["algorithm"]) == key]
        ax_sweep.plot([r["bytes"] for r in sel], [r["busbw_gbps"] for r in sel], styles[key[1]], ms=3, label=f"{key[0]} {key[1]}")
    if rows:
        ax_sweep.set_xscale("log", base=2)
        ax_sweep.set_yscale("log")
        ax_sweep.legend(fontsize=6)
    ax_sweep.set_xlabel("bytes per device")
    ax_sweep.set_ylabel("bus bandwidth GB/s")
    ax_sweep.set_title("allreduce: busbw vs message size")
    ax_sweep.grid(alpha=0.3, which="both")

    bucket_rows = result.tables["bucketed"].rows if "bucketed" in result.tables else []
    labels = [f"{r['model']}\n{r['algorithm']}\n{r['devices']}" for r in bucket_rows]
    bars = ax_buckets.bar(range(len(bucket_rows)), [r["speedup"] for r in bucket_rows], color="tab:orange")
    ax_buckets.bar_label(bars, [f"{r['speedup']:.1f}x" for r in bucket_rows], fontsize=7)
    ax_buckets.axhline(1.0, color="grey", ls=":", lw=1)
    ax_buckets.set_xticks(range(len(bucket_rows)), labels, fontsize=6)
    ax_buckets.set_ylabel("per-tensor time / bucketed time")
    ax_buckets.set_title("bucketed gradients vs one call per tensor")
    ax_buckets.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig
