"""Scale-out on one machine: 1 process x 2 threads vs 2 torchrun ranks x 1 thread each, and
gpulab's gradient sync vs PyTorch's DDP vs sharded (FSDP2), measured side by side in one run.

For LeNet (Fashion-MNIST, 15,360 images, batch 256) and ResNet-18 (1,024 images, batch 64):

  1 process x 2 threads        gpulab train in one process on the CPU (DataParallel)
  2 ranks, sync gpulab         Distributed: buckets all-reduced as backward fills them
  2 ranks, gpulab no overlap   the same buckets, all sent after backward (overlap switched off)
  2 ranks, sync ddp            PyTorch's DistributedDataParallel on the same loop
  2 ranks, shard fsdp          gpulab train --shard fsdp: FSDP2, each rank 1/2 of the state
  3 ranks, sync gpulab / shard fsdp   the same at k = 3 (3 processes on 2 cores: for memory, not speed)

Memory per rank, counted from the tensors themselves after the timed epochs (the sharded part:
parameters + gradients + optimizer state, each rank's local shard for FSDP), and each rank's peak
resident memory (the whole process: torch, the data, activations).

Every row is gpulab's own `build` + `run_epoch` (the code `gpulab train` runs): one warm-up
epoch, then timed epochs. The configurations run in rounds (A B C D, A B C D, ...) because this
VM's speed drifts over minutes; ratios are taken within a round, and the median and range over
rounds are reported.

Hidden share = 1 - wait_overlapped / wait_after_backward, where "wait" is the step's time spent
waiting for gradients after backward (the "allreduce" phase). Without overlap that wait is the
whole exchange; with overlap it is only the part backward did not hide. Measured, not assumed.

Bus bandwidth: gloo's all_reduce between the 2 ranks (loopback TCP) next to gpulab's in-process
ring on cpu*2 (memory copies in one process), busbw = bytes/time * 2(k-1)/k as nccl-tests report it.

    PYTHONPATH=src python benchmarks/distributed.py [--rounds 3] [--out benchmarks/results/<machine>]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gpulab.io import git_commit

MODELS = {
    # model: (training images, global batch, timed epochs)
    "lenet": (15_360, 256, 2),
    "resnet18": (1_024, 64, 2),
}
CONFIGS = {
    # name: (processes, threads per process, sync)
    "1 process x 2 threads": (1, 2, None),
    "2 ranks, sync gpulab": (2, 1, "gpulab"),
    "2 ranks, gpulab no overlap": (2, 1, "gpulab-no-overlap"),
    "2 ranks, sync ddp": (2, 1, "ddp"),
    "2 ranks, shard fsdp": (2, 1, "fsdp"),
    "3 ranks, sync gpulab": (3, 1, "gpulab"),
    "3 ranks, shard fsdp": (3, 1, "fsdp"),
}
BUSBW_SIZES = [4**i * 1024 for i in range(1, 9)]  # 4 KiB .. 64 MiB per rank


# ----------------------------------------------------------------------------- one configuration (a worker)


def worker(spec: dict) -> None:
    """Runs as each rank (under torchrun) or as the one process; rank 0 writes spec['out']."""
    from gpulab.parallel.world import from_environment
    from gpulab.train import TrainConfig, build
    from gpulab.train.loop import run_epoch

    world = from_environment()
    if world.world_size == 1:
        torch.set_num_threads(spec["threads"])
    sync = spec["sync"] or "gpulab"
    cfg = TrainConfig(
        model=spec["model"], devices="cpu", epochs=1 + spec["epochs"], batch_size=spec["batch"], data_dir=spec["data_dir"],
        sync="ddp" if sync == "ddp" else "gpulab", shard="fsdp" if sync == "fsdp" else "none",
    )
    run = build(cfg, world)
    if sync == "gpulab-no-overlap":
        run.strategy.grad_sync.overlap = False
    run_epoch(run, 0)  # warm-up: allocations, oneDNN kernel choice
    epochs = [run_epoch(run, e) for e in range(1, 1 + spec["epochs"])]
    memory = world.gather({"state": state_bytes(run.strategy), "peak_rss": peak_rss_bytes()})
    busbw = measure_gloo_busbw(world) if spec.get("busbw") and world.world_size > 1 else None
    if world.world_size == 1 and spec.get("busbw"):
        busbw = measure_ring_busbw()
    if world.is_main:
        seconds = sum(e["train_seconds"] for e in epochs)
        samples = sum(e["samples_per_s"] * e["train_seconds"] for e in epochs)
        phases = {k: sum(e["phases_s"][k][0] for e in epochs) for k in epochs[0]["phases_s"]}
        result = {
            "samples_per_s": samples / seconds,
            "steps": len(run.train_loader) * len(epochs),
            "seconds": seconds,
            "phases_s": phases,
            "busbw": busbw,
            "memory_per_rank": memory,
            "threads": torch.get_num_threads(),
            "description": run.strategy.description,
        }
        Path(spec["out"]).write_text(json.dumps(result))
    world.close()


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this process holds of `t`: its local shard for a DTensor (FSDP2), else all of it."""
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def state_bytes(strategy) -> dict[str, int]:
    """What each rank holds of the model's training state, counted from the tensors."""
    params = [p for r in strategy.replicas for p in r.parameters()]
    optimizers = strategy.optimizers
    optimizer = sum(local_bytes(v) for opt in optimizers for state in opt.state.values()
                    for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    counted = {"parameters": sum(local_bytes(p) for p in params),
               "gradients": sum(local_bytes(p.grad) for p in params if p.grad is not None),
               "optimizer": optimizer}
    return {**counted, "total": sum(counted.values())}


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def timed_collective(fn, world, calls: int = 10) -> float:
    """Median seconds of `fn` over a fixed number of calls (every rank makes the same calls)."""
    times = []
    for i in range(2 + calls):
        world.barrier()
        t0 = time.perf_counter()
        fn()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_gloo_busbw(world) -> list[dict]:
    import torch.distributed as dist

    k, rows = world.world_size, []
    for nbytes in BUSBW_SIZES:
        t = torch.zeros(nbytes // 4)
        seconds = timed_collective(lambda: dist.all_reduce(t, group=world.group), world)
        rows.append({"bytes": nbytes, "seconds": seconds, "busbw_gbps": nbytes / seconds * 2 * (k - 1) / k / 1e9})
    return rows


def measure_ring_busbw() -> list[dict]:
    from gpulab.bench.harness import measure
    from gpulab.devices import resolve
    from gpulab.parallel import allreduce

    devices, rows = resolve("cpu*2"), []
    for nbytes in BUSBW_SIZES:
        tensors = [torch.zeros(nbytes // 4) for _ in devices]
        timing = measure(lambda: allreduce(tensors, "ring"), devices, repeats=7, max_total_s=2.0)
        rows.append({"bytes": nbytes, "seconds": timing.median_s, "busbw_gbps": nbytes / timing.median_s * 2 * 1 / 2 / 1e9})
    return rows


# ----------------------------------------------------------------------------- the driver


def run_config(name: str, spec: dict, workdir: Path) -> dict:
    processes, threads, sync = CONFIGS[name]
    out = workdir / f"result-{os.getpid()}-{time.monotonic_ns()}.json"
    spec = {**spec, "threads": threads, "sync": sync, "out": str(out)}
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec)]
    if processes > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes), *cmd[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    return json.loads(out.read_text())


def summarize(model: str, rounds: list[dict[str, dict]], configs: list[str]) -> dict:
    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    def ratio(a: str, b: str, of=lambda r, name: r[name]["samples_per_s"]) -> dict | None:
        return spread([of(r, a) / of(r, b) for r in rounds]) if a in configs and b in configs else None

    rows = {name: spread([r[name]["samples_per_s"] for r in rounds]) for name in configs}
    wait = lambda r, name: r[name]["phases_s"].get("allreduce", 0.0)  # noqa: E731
    share = lambda r, name: wait(r, name) / r[name]["seconds"]  # noqa: E731
    ratios = {
        "gpulab / ddp samples/s": ratio("2 ranks, sync gpulab", "2 ranks, sync ddp"),
        "fsdp / gpulab samples/s": ratio("2 ranks, shard fsdp", "2 ranks, sync gpulab"),
        "fsdp / ddp samples/s": ratio("2 ranks, shard fsdp", "2 ranks, sync ddp"),
        "2 ranks gpulab / 1 process samples/s": ratio("2 ranks, sync gpulab", "1 process x 2 threads"),
        "overlap / no overlap samples/s": ratio("2 ranks, sync gpulab", "2 ranks, gpulab no overlap"),
        "hidden share": None if "2 ranks, gpulab no overlap" not in configs else spread(
            [1 - wait(r, "2 ranks, sync gpulab") / wait(r, "2 ranks, gpulab no overlap") for r in rounds]),
        "wait after backward, no overlap (share of step time)": None if "2 ranks, gpulab no overlap" not in configs
        else spread([share(r, "2 ranks, gpulab no overlap") for r in rounds]),
        "wait after backward, overlapped (share of step time)": None if "2 ranks, sync gpulab" not in configs
        else spread([share(r, "2 ranks, sync gpulab") for r in rounds]),
    }
    return {"model": model, "samples_per_s": rows, "ratios": {k: v for k, v in ratios.items() if v},
            "memory": memory_table(rounds[-1], configs), "rounds": rounds}


def memory_table(last_round: dict[str, dict], configs: list[str]) -> dict:
    """Per configuration: rank 0's training state (exact: the tensors), the largest peak RSS of any
    rank, and FSDP's training state as a share of the replicated one at the same k."""
    table = {}
    for name in configs:
        ranks = last_round[name].get("memory_per_rank") or []
        if ranks:
            table[name] = {"state": ranks[0]["state"], "peak_rss_max": max(r["peak_rss"] for r in ranks)}
    for k in (2, 3):
        sharded, replicated = table.get(f"{k} ranks, shard fsdp"), table.get(f"{k} ranks, sync gpulab")
        if sharded and replicated:
            sharded["state_vs_replicated"] = sharded["state"]["total"] / replicated["state"]["total"]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="lenet,resnet18")
    parser.add_argument("--configs", default=";".join(CONFIGS), help="which rows (names separated by ;)")
    parser.add_argument("--out", type=Path, default=None, help="folder for distributed.json and distributed.log")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return

    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)

    from gpulab.data.fashion_mnist import write_subset
    from gpulab.hardware.describe import describe

    configs = [c.strip() for c in args.configs.split(";")]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {list(CONFIGS)}")
    cpu = describe()["cpu"]
    commit = git_commit()  # of the code that runs (the tree may change while it runs)
    say(f"{cpu['model']}, {cpu['logical_cores']} cores, torch {torch.__version__}, {datetime.date.today()}, commit {commit}")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models.split(","):
            num_train, batch, epochs = MODELS[model]
            data_dir = write_subset(Path(tmp) / model, num_train)
            spec = dict(model=model, batch=batch, epochs=epochs, data_dir=str(data_dir), busbw=model == "lenet")
            rounds = []
            for i in range(args.rounds):
                rounds.append({name: run_config(name, spec, Path(tmp)) for name in configs})
                say(f"{model} round {i + 1}: " + ", ".join(f"{n} {r['samples_per_s']:,.0f}" for n, r in rounds[-1].items()))
            summary = summarize(model, rounds, configs)
            results.append(summary)
            say(f"\n{model}: {num_train:,} images, batch {batch}, {epochs} timed epoch(s) after 1 warm-up, {args.rounds} rounds")
            say(f"  {'configuration':32} {'samples/s (median)':>19} {'min':>8} {'max':>8}")
            for name, s in summary["samples_per_s"].items():
                say(f"  {name:32} {s['median']:>19,.0f} {s['min']:>8,.0f} {s['max']:>8,.0f}")
            for name, s in summary["ratios"].items():
                fmt = ".0%" if "share" in name else ".2f"
                say(f"  {name:55} {s['median']:{fmt}}  [{s['min']:{fmt}} .. {s['max']:{fmt}}]")
            say(f"  memory per rank (last round; state = parameters + gradients + optimizer state, rank 0, counted "
                f"from the tensors)")
            for name, m in summary["memory"].items():
                st = m["state"]
                vs = f"  = {m['state_vs_replicated']:.2f}x the replicated state" if "state_vs_replicated" in m else ""
                say(f"  {name:32} state {st['total'] / 2**20:7.1f} MiB (params {st['parameters'] / 2**20:.1f}, grads "
                    f"{st['gradients'] / 2**20:.1f}, optimizer {st['optimizer'] / 2**20:.1f}); peak RSS "
                    f"{m['peak_rss_max'] / 2**20:,.0f} MiB{vs}")
            say()
    last = results[0]["rounds"][-1]
    gloo = last.get("2 ranks, sync gpulab", {}).get("busbw")
    ring = last.get("1 process x 2 threads", {}).get("busbw")
    if gloo and ring:
        say("all-reduce bus bandwidth, 2 ranks/replicas (last round):")
        say(f"  {'bytes per rank':>15} {'gloo, 2 processes':>18} {'gpulab ring, cpu*2':>19}")
        for g, r in zip(gloo, ring):
            say(f"  {g['bytes']:>15,} {g['busbw_gbps']:>14.2f} GB/s {r['busbw_gbps']:>14.2f} GB/s")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        meta = {"cpu": cpu["model"], "cores": cpu["logical_cores"], "torch": torch.__version__, "python": platform.python_version(),
                "date": str(datetime.date.today()), "commit": commit, "rounds": args.rounds}
        (args.out / "distributed.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
        (args.out / "distributed.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
