"""Host-sync detection: gpulab's Tensor method patches vs one TorchFunctionMode, cost per op and per step.

On a CUDA build `gpulab profile` finds host syncs by replacing Tensor methods with timed wrappers
(monitor/record/probes/cuda.py: `CudaSyncProbe.hook`): item, tolist, numpy, cpu, nonzero, __bool__, __int__,
__float__, __index__, __repr__, __format__ (`_timed_sync`) and to, cuda (`_timed_copy`). The
alternative (issue 24, item 4) is one public `torch.overrides.TorchFunctionMode` whose
`__torch_function__` sees every torch function and Tensor method call and acts only on those
names. This script measures what each costs, on this machine's torch, side by side:

  plain    torch as it is
  patches  the 13 Tensor methods replaced through gpulab's own `Patches` by gpulab's own wrappers
           (`CudaSyncProbe._timed_sync` / `_timed_copy`, with a stub sink whose `here()` is the
           real one: is the caller the recorded thread?)
  mode     a TorchFunctionMode whose `__torch_function__` looks `func` up in a dict of the same 13
           methods: a hit goes through the very same wrapper (same checks, same order), a miss
           returns `func(*args, **kwargs)`

Tensors here are on the CPU, so a wrapper passes straight through after its checks (`is_cuda`
False; `to` asks `rec.here()` first and times the call): exactly what happens on a CUDA build for
a CPU tensor. The cost the mode adds to ops it does NOT watch (add, linear, conv, every autograd
property read, ...) is the same on a CUDA build, where it is paid on the host while launching.

1. Per call (timeit, gc off): non-syncs `x.add_(1)`, `torch.add(x, y)`, `lin(v)` (nn.Linear 16->16,
   one row), `x.to(cpu)` (a watched copy), and syncs `t.item()`, `bool(t)` on a 1-element tensor.
2. Per training step: `X.to(dev)`, forward, cross-entropy, `zero_grad`, `backward`, SGD `step`,
   `loss.item()`, for gpulab's LeNet on a batch of 64 (1x28x28) and a tiny MLP (32->64->10,
   batch 16) where per-op overhead dominates. Also counted, once: the calls each mechanism
   routes through Python per step. (On the CPU SGD updates parameter by parameter; on CUDA it
   uses foreach kernels, so a CUDA step shows the mode fewer optimizer calls.)

Each measurement runs in rounds; every round measures all variants, in an order rotated round
by round, so that a shared machine's drift hits all alike: LeNet batch 64 one step per variant
per round (300 rounds), LeNet batch 1 and the MLP a 0.2 s block (31 rounds). Reported: median
[min .. max] over rounds, and the overhead as the per-round paired difference to plain (for
steps also its interquartile range). The cost of either mechanism is per call, not per element:
LeNet at batch 1 makes the same calls as at batch 64, in a step short enough to resolve it, and
gives the batch-64 overhead in % of its step. One torch thread; gc off while timing (timeit's
default; frozen and off for the step phase).

    flock /tmp/gpulab-cpu.lock env PYTHONPATH=src .venv/bin/python benchmarks/sync_hooks_overhead.py \\
        --out benchmarks/results/cpu-amd-epyc-2core
"""

from __future__ import annotations

import argparse
import gc
import statistics
import threading
import time
import timeit
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from gpulab.bench.environment import OtherLoad, contention_warning, environment
from gpulab.io import atomic_write_json
from gpulab.models.lenet import LeNet
from gpulab.monitor.record.patches import Patches
from gpulab.monitor.record.probes.cuda import SYNC_METHODS, CudaSyncProbe

COPY_METHODS = ("to", "cuda")
VARIANTS = ("plain", "patches", "mode")


# ---------------------------------------------------------------------------------- the wrappers

class StubSink:
    """What the wrappers ask of gpulab's sink: `here()` (the same test) and where a sync or copy goes."""

    def __init__(self):
        self.ident = threading.get_ident()
        self.recorded = 0
        self.steps_done = 0

    def here(self) -> bool:
        return threading.get_ident() == self.ident

    def closed_span(self, *args) -> None:
        self.recorded += 1

    def count(self, *args) -> None:
        pass


def make_hooks():
    hooks = CudaSyncProbe(warmup_steps=0)
    hooks.sink = StubSink()  # what install() sets; sync debug mode stays off, as before CUDA is initialised
    return hooks


def install_patches(hooks) -> Patches:
    """What CudaSyncProbe.hook patches (it returns early on a CPU build)."""
    p = Patches()
    hooks.wrap_sync_points(p.patch)
    return p


class SyncMode(TorchFunctionMode):
    """The alternative: one mode, acting only on the same 13 methods, through the same wrappers."""

    def __init__(self, hooks):
        super().__init__()
        # Keys are what __torch_function__ receives: the unpatched methods (TensorBase's, or
        # Tensor.__repr__/__format__ for the two defined in Python).
        self.watched = {getattr(torch.Tensor, n): hooks._timed_sync(getattr(torch.Tensor, n), f"Tensor.{n}")
                        for n in SYNC_METHODS}
        self.watched.update({getattr(torch.Tensor, n): hooks._timed_copy(getattr(torch.Tensor, n), f"Tensor.{n}")
                             for n in COPY_METHODS})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        wrapper = self.watched.get(func)
        if wrapper is not None:
            return wrapper(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


class Variant:
    """Context manager: torch as it is, patched, or inside the mode."""

    def __init__(self, name: str, hooks):
        self.name, self.hooks = name, hooks
        self._patches = self._mode = None

    def __enter__(self):
        if self.name == "patches":
            self._patches = install_patches(self.hooks)
        elif self.name == "mode":
            self._mode = SyncMode(self.hooks)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self._patches is not None:
            self._patches.undo()
            self._patches = None
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None


# ---------------------------------------------------------------------------------- per call

def op_namespace() -> dict:
    torch.manual_seed(0)
    return {
        "torch": torch,
        "x": torch.ones(16), "y": torch.ones(16), "v": torch.ones(1, 16),
        "lin": nn.Linear(16, 16), "t": torch.ones(1), "cpu": torch.device("cpu"),
    }


OPS = {  # name -> statement
    "x.add_(1)": "x.add_(1)",
    "torch.add(x, y)": "torch.add(x, y)",
    "lin(v)  (nn.Linear)": "lin(v)",
    "x.to(cpu)  (watched copy)": "x.to(cpu)",
    "t.item()  (watched sync)": "t.item()",
    "bool(t)  (watched sync)": "bool(t)",
}


def calibrate_ops(ns: dict, target_s: float) -> dict[str, int]:
    numbers = {}
    for name, stmt in OPS.items():
        timer = timeit.Timer(stmt, globals=ns)
        n, took = timer.autorange()
        numbers[name] = max(1000, int(n * target_s / took))
    return numbers


def measure_ops(hooks, rounds: int, target_s: float, say) -> dict:
    ns = op_namespace()
    numbers = calibrate_ops(ns, target_s)
    per_call: dict[str, dict[str, list[float]]] = {op: {v: [] for v in VARIANTS} for op in OPS}
    for variant in VARIANTS:  # one untimed round: every path warm
        with Variant(variant, hooks):
            for name, stmt in OPS.items():
                timeit.Timer(stmt, globals=ns).timeit(numbers[name])
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            with Variant(variant, hooks):
                for name, stmt in OPS.items():
                    timer = timeit.Timer(stmt, globals=ns)  # timeit turns gc off while it times
                    timer.timeit(max(1, numbers[name] // 20))  # warm
                    per_call[name][variant].append(timer.timeit(numbers[name]) / numbers[name])
        say(f"  per-call round {r + 1}/{rounds}: " + ", ".join(
            f"{op.split()[0]} {per_call[op]['plain'][-1] * 1e9:.0f}/{per_call[op]['patches'][-1] * 1e9:.0f}/"
            f"{per_call[op]['mode'][-1] * 1e9:.0f}" for op in OPS) + " ns (plain/patches/mode)")
    return {"number_per_measurement": numbers, "seconds_per_call": per_call}


# ---------------------------------------------------------------------------------- per step

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def make_step(model_name: str):
    torch.manual_seed(0)
    if model_name.startswith("lenet"):
        model, X = LeNet(), torch.randn(64 if model_name == "lenet" else 1, 1, 28, 28)
    else:
        model, X = MLP(), torch.randn(16, 32)
    y = torch.randint(0, 10, (X.shape[0],))
    dev = torch.device("cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses = []

    def step():
        xb, yb = X.to(dev), y.to(dev)
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())

    def run(steps: int) -> float:  # gc is off during the step phase (main): refcounting frees the graphs
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        took = time.perf_counter() - t0
        losses.clear()
        return took / steps

    return step, run


STEP_MODELS = {"lenet": "LeNet, batch 64", "lenet-b1": "LeNet, batch 1", "mlp": "MLP 32-64-10, batch 16"}


def count_intercepts(hooks, step) -> dict:
    """Calls per step each mechanism routes through Python: wrapper calls (patches), and
    __torch_function__ calls (mode), of which how many hit a watched method."""
    counts = {"patches": 0, "mode": 0, "mode_watched": 0}
    p = Patches()

    def counting(orig):
        def wrapper(*args, **kwargs):
            counts["patches"] += 1
            return orig(*args, **kwargs)
        return wrapper

    for name in SYNC_METHODS + COPY_METHODS:
        p.patch(torch.Tensor, name, counting)
    step()
    p.undo()
    watched = set(SyncMode(hooks).watched)

    class Counting(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            counts["mode"] += 1
            counts["mode_watched"] += func in watched
            return func(*args, **(kwargs or {}))

    with Counting():
        step()
    return counts


def measure_steps(hooks, model_name: str, rounds: int, target_s: float | None, say) -> dict:
    """`rounds` rounds, each timing every variant (order rotated) on a block of steps: one step
    (target_s None: LeNet's 25 ms steps, so that variants alternate step by step and a shared
    machine's drift cancels in the pairs), or as many as take target_s (the MLP's 0.2 ms steps)."""
    step, run = make_step(model_name)
    for variant in VARIANTS:  # warm every path
        with Variant(variant, hooks):
            run(5)
    steps = 1 if target_s is None else max(10, int(target_s / run(10)))
    out = {"steps_per_measurement": steps, "intercepted_calls_per_step": count_intercepts(hooks, step),
           "seconds_per_step": {v: [] for v in VARIANTS}}
    sps = out["seconds_per_step"]
    every = max(1, rounds // 10)
    for r in range(rounds):
        order = VARIANTS[r % 3:] + VARIANTS[:r % 3]
        for variant in order:
            with Variant(variant, hooks):
                sps[variant].append(run(steps))
        if (r + 1) % every == 0 or r + 1 == rounds:
            last = slice(-every, None)
            say(f"  {model_name} rounds {r + 2 - every}-{r + 1}/{rounds}, median: " + "/".join(
                f"{statistics.median(sps[v][last]) * 1e3:.3f}" for v in VARIANTS) + " ms per step (plain/patches/mode)")
    return out


# ---------------------------------------------------------------------------------- report

def spread(values: list[float]) -> dict:
    q1, _, q3 = statistics.quantiles(values, n=4)
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "p25": q1, "p75": q3}


def fmt(s: dict, scale: float, digits: int = 0, iqr: bool = False) -> str:
    out = f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f} .. {s['max'] * scale:.{digits}f}]"
    if iqr:
        out += f" (IQR {s['p25'] * scale:.{digits}f} .. {s['p75'] * scale:.{digits}f})"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op-rounds", type=int, default=21)
    parser.add_argument("--lenet-rounds", type=int, default=300, help="rounds of one LeNet batch-64 step per variant")
    parser.add_argument("--block-rounds", type=int, default=31, help="rounds for LeNet batch 1 and the MLP")
    parser.add_argument("--op-seconds", type=float, default=0.05, help="time per (op, variant, round) measurement")
    parser.add_argument("--block-seconds", type=float, default=0.2,
                        help="time per (variant, round) measurement of LeNet batch 1 and the MLP")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="folder for sync_hooks_overhead.json and .log")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    env = environment()  # before the run: load average and CPU busy say whether the machine was quiet
    lines: list[str] = []

    def say(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    say(f"torch {torch.__version__}, {env['cpu']['model']} x{env['cpu']['logical_cores']}, {args.threads} torch thread(s), "
        f"load avg {env['load_avg_1m']}, CPU busy before start {env['cpu_busy_pct']:.0f}%")
    hooks = make_hooks()
    t_start = time.perf_counter()
    load = OtherLoad()
    ops = measure_ops(hooks, args.op_rounds, args.op_seconds, say)
    other_load = {"per_call": round(load.pct(), 1)}
    t_ops = time.perf_counter()
    load = OtherLoad()
    gc.collect()
    gc.freeze()  # torch's objects out of the collector's way
    gc.disable()
    steps = {"lenet": measure_steps(hooks, "lenet", args.lenet_rounds, None, say),
             "lenet-b1": measure_steps(hooks, "lenet-b1", args.block_rounds, args.block_seconds, say),
             "mlp": measure_steps(hooks, "mlp", args.block_rounds, args.block_seconds, say)}
    gc.enable()
    other_load["per_step"] = round(load.pct(), 1)
    t_steps = time.perf_counter()
    assert hooks.sink.recorded == 0, "a CPU tensor must never be recorded"

    summary: dict = {"per_call": {}, "per_step": {}}
    say()
    say(f"Per call, ns: median [min .. max] over {args.op_rounds} rounds; overhead = paired difference to plain")
    say(f"  {'op':28} {'plain':>20} {'patches':>20} {'mode':>20} {'patches - plain':>20} {'mode - plain':>20}")
    for op, by_variant in ops["seconds_per_call"].items():
        row = {v: spread(by_variant[v]) for v in VARIANTS}
        for v in ("patches", "mode"):
            row[f"{v} - plain"] = spread([a - b for a, b in zip(by_variant[v], by_variant["plain"])])
        summary["per_call"][op] = row
        say(f"  {op:28} " + " ".join(f"{fmt(row[k], 1e9):>20}" for k in
                                     ("plain", "patches", "mode", "patches - plain", "mode - plain")))
    say()
    say("Per training step, ms: median [min .. max] over rounds; overhead = paired difference to plain, in us and %")
    for model_name, data in steps.items():
        sps = data["seconds_per_step"]
        c = data["intercepted_calls_per_step"]
        row = {v: spread(sps[v]) for v in VARIANTS}
        for v in ("patches", "mode"):
            row[f"{v} - plain"] = spread([a - b for a, b in zip(sps[v], sps["plain"])])
            row[f"{v} / plain - 1"] = spread([a / b - 1 for a, b in zip(sps[v], sps["plain"])])
        row["intercepted_calls_per_step"] = c
        summary["per_step"][model_name] = row
        rounds = len(sps["plain"])
        say(f"  {STEP_MODELS[model_name]}: {rounds} rounds of {data['steps_per_measurement']} step(s) per variant")
        say(f"    calls routed through Python per step: patches {c['patches']} (wrapper calls), "
            f"mode {c['mode']} (__torch_function__ calls, {c['mode_watched']} of them watched)")
        for v in VARIANTS:
            line = f"    {v:8} {fmt(row[v], 1e3, 3):>28} ms"
            if v != "plain":
                line += (f"   overhead {fmt(row[f'{v} - plain'], 1e6, 1, iqr=True):>48} us/step  "
                         f"{fmt(row[f'{v} / plain - 1'], 100, 1, iqr=True):>40} %")
            say(line)
    say()
    say("Mode vs patches (median of the paired overheads):")
    for op, row in summary["per_call"].items():
        p, m = row["patches - plain"]["median"] * 1e9, row["mode - plain"]["median"] * 1e9
        say(f"  {op:28} patches {p:+7.0f} ns, mode {m:+7.0f} ns per call")
    for model_name, row in summary["per_step"].items():
        p, m = row["patches - plain"]["median"] * 1e6, row["mode - plain"]["median"] * 1e6
        pp, mp = row["patches / plain - 1"]["median"] * 100, row["mode / plain - 1"]["median"] * 100
        say(f"  {STEP_MODELS[model_name]:28} patches {p:+7.1f} us ({pp:+.1f}%), mode {m:+7.1f} us ({mp:+.1f}%) per step")
    b1, b64 = summary["per_step"]["lenet-b1"], summary["per_step"]["lenet"]
    say("  LeNet batch 64, its overhead read at batch 1 (same calls, same per-call cost, in a step short enough to "
        "time precisely; single batch-64 steps vary by milliseconds):")
    for v in ("patches", "mode"):
        d = b1[f"{v} - plain"]
        say(f"    {v:8} {d['median'] * 1e6:+7.1f} us per step = {d['median'] / b64['plain']['median'] * 100:+.2f}% "
            f"of the batch-64 step [{d['min'] / b64['plain']['median'] * 100:+.2f} .. {d['max'] / b64['plain']['median'] * 100:+.2f}]")
    say(f"\ntook {time.perf_counter() - t_start:.0f} s (per call {t_ops - t_start:.0f} s, per step {t_steps - t_ops:.0f} s); "
        f"other processes used {other_load['per_call']:.0f}% / {other_load['per_step']:.0f}% of the CPU meanwhile")
    if max(other_load.values()) > 10:
        say("warning: " + contention_warning(max(other_load.values()), "meanwhile"))

    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "sync_hooks_overhead",
            "git_commit": env["git_commit"],
            "environment": env,
            "settings": vars(args) | {"out": str(args.out)},
            "other_load_pct": other_load,
            "ops": OPS,
            "summary": summary,
            "rounds": {"per_call": ops, "per_step": steps},
        }
        atomic_write_json(args.out / "sync_hooks_overhead.json", result)
        (args.out / "sync_hooks_overhead.log").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
