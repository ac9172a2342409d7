"""`gpulab plan`: will k devices, or n machines, make this training faster?

    measure one device's step (`step`) at each per-device batch the plan needs
    measure the allreduce between local ranks (`collective`), or take a link (`links`)
    predict each (machines, devices per machine) configuration (`predict`)
    find the smallest per-device batch at which k devices reach >= 90% efficiency
    [--check: run what this machine can run, and compare (`check`)]

One device is what one rank of `gpulab launch` gets: a GPU, or on a CPU machine its share of
the cores (cores / ranks per machine), measured with that many copies running at once.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from gpulab.errors import UserError
from gpulab.host import usable_cores
from gpulab.plan import collective, step
from gpulab.plan.links import LinkCost, parse_link, slowest
from gpulab.plan.peak_memory import MemoryLine, fit_line
from gpulab.plan.predict import ASSUMPTIONS, SHARDED_ASSUMPTION, Prediction, predict
from gpulab.plan.profile import StepProfile

TARGET_EFFICIENCY = 0.9
SWEEP_MAX_STEP_S = 2.0
"""The batch sweep stops growing the batch once one step takes this long."""


@dataclass(kw_only=True)
class PlanConfig:
    train: dict
    """gpulab train's options (model, batch_size, devices, recipe, precision, ...)."""
    devices_per_node: list[int] = field(default_factory=lambda: [1, 2])
    nodes: list[int] = field(default_factory=lambda: [1])
    link: str | None = None
    """Between machines: a name from LINKS or GB/s,us (needed when some nodes > 1)."""
    device_link: str | None = None
    """Between the devices of one machine; default: measured here."""
    profile_seconds: float = 3.0
    sweep: bool = True
    memory: int | None = None
    """Bytes of memory per device to plan within (--memory); default: this GPU's, or on a CPU this
    machine's memory shared by the ranks it runs."""

    @property
    def sharded(self) -> bool:
        """--shard fsdp: predicted with FSDP's gathers and reduce-scatters."""
        return self.train.get("shard") == "fsdp"

    def __post_init__(self):
        if not (math.isfinite(self.profile_seconds) and self.profile_seconds > 0):
            raise UserError(f"--seconds {self.profile_seconds:g}: give the seconds of steps each profile measures, "
                            "e.g. --seconds 3")
        batch = self.train["batch_size"]
        self.devices_per_node, self.nodes = list(dict.fromkeys(self.devices_per_node)), list(dict.fromkeys(self.nodes))
        for k in self.devices_per_node:
            if k < 1:
                raise UserError(f"--devices-per-node {k}: give 1 or more devices per machine")
        for n in self.nodes:
            if n < 1:
                raise UserError(f"--nodes {n}: give 1 or more machines")
        for n in self.nodes:
            for k in self.devices_per_node:
                if n * k > batch:
                    raise UserError(
                        f"--batch-size {batch} over {n * k} devices leaves some with no sample: "
                        f"use a batch of at least {n * k}, or fewer devices")
        if self.link is not None:
            parse_link(self.link)
        elif max(self.nodes) > 1:
            raise UserError("--nodes > 1: say what joins the machines with --link (e.g. 25gbe, ndr400, or GB/s,us)")
        if self.device_link is not None:
            parse_link(self.device_link)


# What --devices may name in a plan: a kind of device (gpulab.devices' grammar, less cpu*K and
# lists, read from the text: the plan's parent imports no torch)
_KIND = re.compile(r"auto|all|cpu|(cuda|gpu)(:\d+)?")


def device_kind(train: dict) -> str:
    """'cuda' when the plan's devices are GPUs, else 'cpu'. --devices names the kind only: how many
    a machine has is --devices-per-node."""
    spec = train.get("devices")
    spec = "auto" if spec is None else spec
    text = spec.strip().lower().replace(" ", "")
    if not _KIND.fullmatch(text):
        raise UserError(f"--devices {spec}: a plan names the kind of device (cpu, cuda or auto); say how many per "
                        "machine with --devices-per-node, e.g. --devices cpu --devices-per-node 1 2")
    if text == "cpu":
        return "cpu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if text not in ("auto", "all"):
        raise UserError(f"--devices {spec}: torch sees no GPU here; plan for the CPU with --devices cpu")
    return "cpu"


class Profiles:
    """Step profiles, measured once per (per-device batch, devices per machine)."""

    def __init__(self, cfg: PlanConfig, kind: str, say=print):
        self.cfg, self.kind, self.say = cfg, kind, say
        self.cache: dict[tuple[int, int], StepProfile] = {}

    def get(self, batch: int, per_node: int) -> StepProfile:
        key = (batch, per_node)
        if key not in self.cache:
            threads, copies = self.share(per_node)
            self.say(f"measuring one step at {batch} samples per device ({threads} thread(s), {copies} at once)")
            train = {**self.cfg.train, "devices": "cpu" if self.kind == "cpu" else "cuda:0"}
            self.cache[key] = step.measure(train, batch, threads, seconds=self.cfg.profile_seconds, copies=copies)
        return self.cache[key]

    def share(self, per_node: int) -> tuple[int, int]:
        """(threads, concurrent copies) of one device: on a CPU, per_node ranks share the cores."""
        if self.kind == "cpu":
            return max(1, usable_cores() // per_node), per_node
        return 1, 1


def measured_device_link(kind: str, largest_bucket: int, say=print) -> LinkCost:
    """Allreduce between 2 ranks of this machine: gloo over loopback, or NCCL between 2 GPUs."""
    if kind == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise UserError("one GPU here: say what joins the GPUs of a machine with --device-link (e.g. nvlink4, pcie5)")
    backend = "nccl" if kind == "cuda" else "gloo"
    sizes = collective.default_sizes(largest_bucket)
    say(f"measuring allreduce between 2 ranks ({backend}) at {len(sizes)} sizes up to {largest_bucket:,} bytes")
    r = collective.measure(2, sizes, backend=backend)
    where = "2 GPUs" if kind == "cuda" else "loopback"
    return collective.fit(r["sizes"], r["seconds"], 2, f"measured: {backend}, 2 ranks on {where}")


@dataclass
class SweepPoint:
    prediction: Prediction
    speedup: float
    """k devices at this per-device batch vs one device at the same global batch."""

    @property
    def credible_gain(self) -> bool:
        """Faster than one device, by no more than k devices can be."""
        return 1 < self.speedup <= self.prediction.devices


@dataclass
class Plan:
    config: PlanConfig
    kind: str
    one_device: Prediction
    rows: list[Prediction]
    speedups: list[float]
    sweep: dict[tuple[int, int], list[SweepPoint]]
    """(nodes, devices per node) -> predictions over per-device batches."""
    links: dict[str, LinkCost]
    profiles: list[StepProfile]
    memory_line: MemoryLine | None = None
    """Peak memory per device against the per-device batch, fitted through the profiles."""

    def memory_budget(self, per_node: int) -> tuple[int, str]:
        """(bytes per device, where that figure comes from) for `per_node` devices per machine."""
        if self.config.memory:
            return self.config.memory, "--memory"
        if self.kind == "cuda":
            import torch

            # every device of a configuration holds the same replica: the smallest GPU bounds it
            smallest = min(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
            return smallest, "this GPU's memory" if torch.cuda.device_count() == 1 else "the smallest GPU's memory"
        import psutil

        total = psutil.virtual_memory().total
        return total // per_node, "this machine's memory" + (f" / {per_node} ranks" if per_node > 1 else "")

    def smallest_efficient_batch(self, nodes: int, per_node: int) -> int | None:
        """The smallest per-device batch of the sweep at which k devices reach TARGET_EFFICIENCY."""
        return next((p.prediction.per_device_batch for p in self.sweep.get((nodes, per_node), [])
                     if p.prediction.efficiency >= TARGET_EFFICIENCY), None)

    def smallest_paying_batch(self, nodes: int, per_node: int) -> int | None:
        """The smallest global batch of the sweep at which k devices beat one - by no more than k
        can (a point past k is its measurements' noise, not a batch that pays)."""
        return next((p.prediction.global_batch for p in self.sweep.get((nodes, per_node), []) if p.credible_gain),
                    None)


def sweep_batches(batch: int) -> list[int]:
    """Per-device batches of the sweep: 4, 16, 64, ... up to 16x the batch."""
    out, b = [], 4
    while b <= 16 * batch:
        out.append(b)
        b *= 4
    return out


def make_plan(cfg: PlanConfig, say=print) -> Plan:
    kind = device_kind(cfg.train)
    most = max(2, usable_cores())  # 1 vs 2 devices is the default plan, on any machine
    if kind == "cpu" and max(cfg.devices_per_node) > most:
        # each device of a CPU plan is a process measured beside the others on these cores: more
        # of them than cores measure the crowding, and start that many copies of torch at once
        raise UserError(f"--devices-per-node {max(cfg.devices_per_node)}: a CPU plan runs a process per device on "
                        f"this machine's {usable_cores()} usable core(s); plan for at most {most}")
    batch = cfg.train["batch_size"]
    profiles = Profiles(cfg, kind, say)
    one = profiles.get(batch, 1)
    one_device = predict(one, None, 1)
    links: dict[str, LinkCost] = {}
    if max(cfg.devices_per_node) > 1:
        links["device"] = (parse_link(cfg.device_link) if cfg.device_link
                           else measured_device_link(kind, max(one.bucket_bytes), say))
    if cfg.link:
        links["node"] = parse_link(cfg.link)

    def at(per_device: int, nodes: int, per_node: int, global_batch: int | None = None) -> Prediction:
        k = nodes * per_node
        return predict(profiles.get(per_device, per_node), ring_link(links, nodes, per_node), k, nodes, global_batch,
                       sharded=cfg.sharded, profile_link=links.get("device"))

    rows, speedups = [], []
    for nodes in cfg.nodes:
        for per_node in cfg.devices_per_node:
            row = at(batch // (nodes * per_node), nodes, per_node, global_batch=batch)
            rows.append(row)
            speedups.append(row.samples_per_s / one_device.samples_per_s)
    sweep: dict[tuple[int, int], list[SweepPoint]] = {}
    if cfg.sweep:
        for nodes in cfg.nodes:
            for per_node in cfg.devices_per_node:
                k = nodes * per_node
                if k == 1:
                    continue
                points = sweep[(nodes, per_node)] = []
                for b in sweep_batches(batch):
                    p = at(b, nodes, per_node)
                    single = predict(profiles.get(b * k, 1), None, 1)
                    points.append(SweepPoint(p, p.samples_per_s / single.samples_per_s))
                    if (p.efficiency >= TARGET_EFFICIENCY and points[-1].credible_gain) or single.compute_s > SWEEP_MAX_STEP_S:
                        break
    return Plan(config=cfg, kind=kind, one_device=one_device, rows=rows, speedups=speedups, sweep=sweep,
                links=links, profiles=list(profiles.cache.values()), memory_line=fit_line(list(profiles.cache.values())))


def ring_link(links: dict[str, LinkCost], nodes: int, per_node: int) -> LinkCost | None:
    """The ring's link: within one machine the devices' ("device"), across machines the machines'
    ("node") - and where each machine has several devices, the ring's hops are of both kinds."""
    if nodes * per_node == 1:
        return None
    if nodes == 1:
        return links["device"]
    return slowest(links["node"], links["device"]) if per_node > 1 else links["node"]


__all__ = ["ASSUMPTIONS", "SHARDED_ASSUMPTION", "Plan", "PlanConfig", "make_plan"]
