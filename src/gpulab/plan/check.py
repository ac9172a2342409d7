"""`gpulab plan --check`: run the configurations this machine can run, for real, with gpulab
train itself, and put their measured samples/s next to the plan's prediction.

    1 process            gpulab train, every core
    2 ranks              gpulab launch -n 2 (torchrun, gloo over loopback), a core each
    2 agents             two torchrun agents (--nnodes 2) on loopback: "two machines" in one
    2 hosts @ R Mbit/s   two network namespaces on a tc-limited veth link (root only)

Each run trains on a small copy of Fashion-MNIST for two epochs; the second epoch's samples/s
(the first one warms up) is the measurement.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gpulab.errors import UserError
from gpulab.plan.collective import Host, child_pythonpath, rendezvous, wait_all
from gpulab.plan.profile import StepProfile


CHECK_LR = 1e-3


@dataclass
class Measured:
    name: str
    samples_per_s: float
    command: str
    out: Path


def train_args(cfg: dict, data_dir: Path, out: Path) -> list[str]:
    # The runs are timed, not judged by accuracy: a small learning rate keeps a few steps of a
    # BatchNorm model on a small copy from tripping gpulab train's divergence stop.
    args = ["--model", cfg["model"], "--batch-size", str(cfg["batch_size"]), "--epochs", "2",
            "--data-dir", str(data_dir), "--out", str(out), "--devices", "cpu", "--lr", str(CHECK_LR)]
    for option in ("recipe", "precision", "channels_last", "sync", "shard"):
        if cfg.get(option) is not None:
            args += [f"--{option.replace('_', '-')}", str(cfg[option])]
    return args


def run_training(name: str, cfg: dict, data_dir: Path, workdir: Path, ranks_per_host: int = 1,
                 hosts: list[Host] | None = None, threads: int | None = None, timeout_s: float = 900.0,
                 extra: tuple[str, ...] = ()) -> Measured:
    """gpulab train as `name` says (`extra`: more of its options); samples/s of its last epoch."""
    out = workdir / name.replace(" ", "-").replace("/", "-")
    args = [*train_args(cfg, data_dir, out), *extra]
    gpulab = [sys.executable, "-m", "gpulab"]
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if hosts is None and ranks_per_host == 1:
        commands = [(gpulab + ["train", *args], env)]
    elif hosts is None:
        commands = [(gpulab + ["launch", "-n", str(ranks_per_host), "--", *args], env)]
    else:
        master = "{}:{}".format(*rendezvous(hosts))
        commands = [
            ([*h.prefix, *gpulab, "launch", "-n", str(ranks_per_host), "--nnodes", str(len(hosts)), "--node-rank", str(r),
              "--master", master, "--", *args], {**env, **h.env})
            for r, h in enumerate(hosts)
        ]
    procs = [subprocess.Popen(cmd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for cmd, e in commands]
    failed = wait_all(procs, timeout_s)
    if failed:
        raise UserError(f"plan --check: the {name} run failed: {failed}")
    history = json.loads((out / "metrics.json").read_text())
    shown = " & ".join(" ".join(cmd[cmd.index("-m") + 1:] if "-m" in cmd else cmd) for cmd, _ in commands)
    return Measured(name=name, samples_per_s=history[-1]["samples_per_s"], command=shown, out=out)


def small_copy(cfg: dict, workdir: Path, steps: int) -> Path:
    """Enough Fashion-MNIST images for `steps` steps per epoch (and 256 test images)."""
    from gpulab.data.fashion_mnist import write_subset

    return write_subset(workdir / "data", cfg["batch_size"] * steps, data_dir=cfg.get("data_dir"))


def scratch() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="gpulab-plan-check-")


# ----------------------------------------------------------------------------- predicted vs measured


@dataclass
class Setup:
    name: str
    devices: int
    ranks_per_host: int = 1
    hosts: int = 0
    """0: no test hosts; 2: two hosts, each in its own network namespace."""
    agents: int = 0
    """2: two torchrun agents on loopback."""
    rate_mbit: float | None = None


def setups(rates_mbit: list[float], with_hosts: bool) -> list[Setup]:
    out = [Setup("1 process", 1), Setup("2 ranks", 2, ranks_per_host=2), Setup("2 agents on loopback", 2, agents=2)]
    if with_hosts:
        out += [Setup(f"2 hosts at {r:g} Mbit/s", 2, hosts=2, rate_mbit=r) for r in rates_mbit]
    return out


def check(cfg: dict, rates_mbit: list[float], rounds: int = 3, profile_seconds: float = 3.0,
          say=print) -> tuple[list[dict], dict]:
    """Every setup, `rounds` times in turn (this machine's speed drifts over minutes, so each
    prediction is made from profiles and a link measured around its run); then memory
    (check_memory). Returns the setups' summaries and the memory check."""
    from gpulab.plan import netns, step
    from gpulab.host import usable_cores

    why_not = netns.available()
    if why_not:
        say(f"skipping the 2-host check: {why_not}")
    chosen = setups(rates_mbit, with_hosts=why_not is None)
    batch = cfg["batch_size"]
    results: dict[str, list[dict]] = {s.name: [] for s in chosen}
    with scratch() as tmp:
        tmp = Path(tmp)
        first = step.measure(cfg, batch, usable_cores(), seconds=profile_seconds)
        # An epoch of about twice the profile's length: the measured epoch averages as much drift.
        steps = max(8, min(200, round(2 * profile_seconds / first.step_s)))
        data_dir = small_copy(cfg, tmp, steps)
        cfg = {**cfg, "data_dir": str(data_dir)}  # profiles and runs on the same data, in the same state
        profiles: dict[str, StepProfile] = {}  # each setup's first profile, for the memory check
        for r in range(rounds):
            for s in chosen:
                say(f"round {r + 1}/{rounds}: {s.name}")
                row, profile = one_round(s, r, cfg, data_dir, tmp, profile_seconds, say)
                results[s.name].append(row)
                profiles.setdefault(s.name, profile)
        memory = check_memory(cfg, data_dir, tmp, {k: v for k, v in profiles.items() if k in MEMORY_SETUPS}, say)
    return [summarize(s, results[s.name]) for s in chosen], memory


# ----------------------------------------------------------------------------- memory

MEMORY_SETUPS = {"1 process": 1, "2 ranks": 2}
"""Setups whose memory per device is checked, with their ranks (agents and test hosts hold what
2 ranks hold)."""
FITS_SCALE = 4
"""The largest-batch check plans for a budget that fits about this many times the batch."""


def check_memory(cfg: dict, data_dir: Path, tmp: Path, profiles: dict[str, StepProfile], say) -> dict:
    """Predicted vs measured peak memory per device for each of MEMORY_SETUPS (gpulab train --profile:
    its measured step, on rank 0; with --shard fsdp the ranks shard and the prediction is the
    sharded peak), then the largest-batch verdict (replicated, one process): for a budget the line through
    those profiles says fits FITS_SCALE x the batch, the step at that largest batch and at 25%
    more, each measured (and on CUDA run under the budget: gpulab.plan.fits)."""
    from gpulab.plan.peak_memory import fit_line, replicated_peak, sharded_peak, sync_of

    sync = sync_of(cfg)
    sharded = cfg.get("shard") == "fsdp"
    replicated = {**cfg, "shard": "none"}  # one process (and the largest-batch runs) cannot shard
    rows = []
    for name, ranks in MEMORY_SETUPS.items():
        say(f"memory: {name}")
        shards = sharded and ranks > 1
        run = run_training(f"memory {name}", cfg if shards else replicated, data_dir, tmp, ranks_per_host=ranks,
                           extra=("--epochs", "1", "--profile"))
        measured = json.loads((run.out / "profile" / "report.json").read_text())["memory"]
        step_memory = profiles[name].memory
        profile = profiles[name]
        measured_shards = (profile.copies, profile.sharded_peak) if profile.sharded_peak else None
        predicted = (sharded_peak(step_memory, ranks, measured_shards) if shards
                     else replicated_peak(step_memory, sync))
        rows.append({"name": name, "per_device_batch": profiles[name].batch, "predicted_peak": predicted,
                     "measured_peak": measured["peak"], "error": predicted / measured["peak"] - 1,
                     "measured_at": measured.get("peak_phase")})
    line = fit_line(list(profiles.values()))
    budget = int(line.at(FITS_SCALE * cfg["batch_size"]))
    largest = line.largest_batch(budget)
    runs = [fits(replicated, b, budget, tmp) for b in (largest, round(1.25 * largest))]
    say(f"memory: within {budget:,} bytes the plan says batch {largest} fits: it "
        f"{'does' if runs[0]['fits'] else 'does NOT'}; {runs[1]['batch']} {'does not' if not runs[1]['fits'] else 'DOES'}")
    return {"setups": rows, "line": {"fixed_bytes": line.fixed, "bytes_per_sample": line.per_sample},
            "budget": budget, "largest_batch": largest, "runs": runs,
            "verdict_holds": runs[0]["fits"] and not runs[1]["fits"]}


def fits(cfg: dict, batch: int, budget: int, tmp: Path, timeout_s: float = 900.0) -> dict:
    """gpulab.plan.fits in its own process: does the step at `batch` fit `budget`?"""
    out = tmp / f"fits-{batch}.json"
    spec = {"cfg": cfg, "batch": batch, "budget": budget, "out": str(out)}
    env = {**os.environ, "PYTHONPATH": child_pythonpath()}
    proc = subprocess.Popen([sys.executable, "-m", "gpulab.plan.fits", json.dumps(spec)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    failed = wait_all([proc], timeout_s)
    if failed:
        raise UserError(f"plan --check: measuring the step at batch {batch} failed: {failed}")
    return json.loads(out.read_text())


def one_round(s: Setup, r: int, cfg: dict, data_dir: Path, tmp: Path, profile_seconds: float,
              say) -> tuple[dict, StepProfile]:
    """Profile, measure the link, run for real, profile again: the prediction is made from the
    two profiles that bracket the run (this machine's speed drifts between them). On test hosts
    all of it runs across their link. The round's record, and its first profile."""
    from contextlib import nullcontext

    from gpulab.plan import collective, netns, step
    from gpulab.plan.links import parse_link
    from gpulab.host import usable_cores
    from gpulab.plan.predict import predict

    batch = cfg["batch_size"]
    sharded = cfg.get("shard") == "fsdp"
    if s.devices == 1:  # one process cannot shard: the baseline is the replicated step
        cfg = {**cfg, "shard": "none"}

    def profile(hosts):
        if s.devices == 1:
            return step.measure(cfg, batch, usable_cores(), seconds=profile_seconds)
        return step.measure(cfg, batch // 2, max(1, usable_cores() // 2), seconds=profile_seconds, copies=2, hosts=hosts)

    with netns.test_hosts(s.rate_mbit) if s.hosts else nullcontext(None) as hosts:
        before = profile(hosts)  # on test hosts the profile's gradient exchange crosses their link, as the run's
        link, timings = None, None
        if s.devices > 1:
            sizes = collective.default_sizes(max(before.bucket_bytes))
            timings = collective.measure(2, sizes, hosts=hosts)
            link = collective.fit(timings["sizes"], timings["seconds"], 2, f"measured: gloo, {s.name}")
        measured = run_training(
            f"{s.name} round {r + 1}", cfg, data_dir, tmp, ranks_per_host=s.ranks_per_host,
            hosts=hosts or ([collective.Host(), collective.Host()] if s.agents else None),
            threads=1 if (s.hosts or s.agents) else None,
        )
        after = profile(hosts)

    def samples_per_s(link_cost) -> float:
        steps = [predict(p, link_cost, s.devices, sharded=sharded).step_s for p in (before, after)]
        return batch / (sum(steps) / len(steps))

    predicted = samples_per_s(link)
    nominal = samples_per_s(parse_link(f"{s.rate_mbit / 8000:g},0")) if s.rate_mbit else None
    say(f"  predicted {predicted:,.0f} samples/s, measured {measured.samples_per_s:,.0f}")
    return {
        "predicted": predicted, "measured": measured.samples_per_s,
        "ideal": batch / ((before.step_s + after.step_s) / 2),
        "exposed_s": predict(before, link, s.devices, sharded=sharded).exposed_s,
        "link": link.__dict__ if link else None, "allreduce_timings": timings,  # raw, so that a fit can be redone
        "nominal_predicted": nominal, "command": measured.command,
        "profile_step_s": [before.step_s, after.step_s], "overlap": [before.overlap, after.overlap],
    }, before


def summarize(s: Setup, rounds: list[dict]) -> dict:
    import statistics

    median = statistics.median
    predicted, measured = median(r["predicted"] for r in rounds), median(r["measured"] for r in rounds)
    nominal = [r["nominal_predicted"] for r in rounds if r["nominal_predicted"]]
    return {
        "name": s.name, "devices": s.devices, "rate_mbit": s.rate_mbit,
        "predicted_samples_per_s": predicted, "measured_samples_per_s": measured,
        "error": predicted / measured - 1,
        "round_errors": [r["predicted"] / r["measured"] - 1 for r in rounds],
        "ideal_samples_per_s": median(r["ideal"] for r in rounds),
        "nominal_link_predicted_samples_per_s": median(nominal) if nominal else None,
        "rounds": rounds,
    }
