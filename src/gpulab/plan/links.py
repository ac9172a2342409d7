"""The cost of one allreduce, and the links it can run over.

A ring allreduce of S bytes over k devices takes 2(k-1) steps (reduce-scatter, then all-gather),
each sending S/k bytes to the next device, so with a per-step latency alpha and a per-byte cost
beta (1 / the link's bandwidth):

    T(S, k) = 2(k-1) * alpha  +  2(k-1)/k * S * beta

(Thakur, Rabenseifner & Gropp 2005; the same 2(k-1)/k is nccl-tests' "bus bandwidth" factor.)
An all-gather or a reduce-scatter is half of it: (k-1) alpha + (k-1)/k S beta (what sharded
training, --shard fsdp, sends: each unit's parameters gathered in forward and again in backward,
its gradients reduce-scattered). A `LinkCost` holds alpha and beta, measured (`gpulab.plan.collective`) or from `LINKS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpulab.errors import UserError


@dataclass(frozen=True)
class LinkCost:
    alpha_s: float
    """Latency of one ring step (seconds)."""
    beta_s_per_byte: float
    """Seconds per byte on the link: 1 / bandwidth."""
    source: str
    """Where the figures come from: 'measured: gloo, 2 ranks on loopback', 'nominal: 25GbE', ..."""

    @property
    def bandwidth_gbps(self) -> float:
        """GB/s (1e9 bytes per second)."""
        return 1 / self.beta_s_per_byte / 1e9 if self.beta_s_per_byte > 0 else math.inf

    def allreduce_s(self, nbytes: float, k: int) -> float:
        """Seconds of one ring allreduce of `nbytes` over `k` devices (0 for one device)."""
        return 2 * self.gather_s(nbytes, k)

    def gather_s(self, nbytes: float, k: int) -> float:
        """Seconds of one ring all-gather (or reduce-scatter) whose whole tensor is `nbytes`: half
        an allreduce, (k-1) steps of S/k bytes each (0 for one device)."""
        if k <= 1:
            return 0.0
        return (k - 1) * self.alpha_s + (k - 1) / k * nbytes * self.beta_s_per_byte


def slowest(a: LinkCost, b: LinkCost) -> LinkCost:
    """One ring over two kinds of hop (devices within a machine, machines between them) goes as fast
    as its slowest hop: the larger latency and the lower bandwidth."""
    return LinkCost(max(a.alpha_s, b.alpha_s), max(a.beta_s_per_byte, b.beta_s_per_byte),
                    f"the slower hop of each ({a.source}; {b.source})")


# Published peak figures per direction. They are what the hardware can carry, not what an
# allreduce achieves (nccl-tests typically reaches 80-95% of them); the plan says "nominal".
# name: (GB/s, latency in microseconds, source)
LINKS: dict[str, tuple[float, float, str]] = {
    # NVIDIA H100 datasheet: NVLink 4 900 GB/s per GPU, both directions -> 450 GB/s each way.
    "nvlink4": (450.0, 2.0, "NVIDIA H100 Tensor Core GPU datasheet (NVLink 900 GB/s bidirectional)"),
    # PCI-SIG: PCIe 4.0 16 GT/s per lane, 128b/130b -> 31.5 GB/s per direction on x16.
    "pcie4": (31.5, 5.0, "PCI-SIG PCIe 4.0 base specification (16 GT/s x16, 128b/130b)"),
    # PCI-SIG: PCIe 5.0 32 GT/s per lane -> 63 GB/s per direction on x16.
    "pcie5": (63.0, 5.0, "PCI-SIG PCIe 5.0 base specification (32 GT/s x16, 128b/130b)"),
    # IEEE 802.3 line rates; TCP latency between racks ~ 20-50 us (kernel network stack).
    "10gbe": (1.25, 30.0, "IEEE 802.3ae 10 Gb/s Ethernet line rate"),
    "25gbe": (3.125, 25.0, "IEEE 802.3by 25 Gb/s Ethernet line rate"),
    "100gbe": (12.5, 10.0, "IEEE 802.3ba 100 Gb/s Ethernet line rate"),
    # InfiniBand NDR 400 Gb/s (NVIDIA ConnectX-7 datasheet), RDMA latency ~ 1-2 us.
    "ndr400": (50.0, 2.0, "NVIDIA ConnectX-7 datasheet (InfiniBand NDR 400 Gb/s)"),
}


def parse_link(spec: str) -> LinkCost:
    """`--link NAME` from LINKS, or `--link GB/s,us` (bandwidth in GB/s, latency in microseconds)."""
    name = spec.strip().lower()
    if name in LINKS:
        gbps, latency_us, _ = LINKS[name]
        return LinkCost(latency_us * 1e-6, 1 / (gbps * 1e9), f"nominal: {name} ({gbps:g} GB/s, {latency_us:g} us)")
    parts = name.split(",")
    try:
        gbps, latency_us = float(parts[0]), float(parts[1]) if len(parts) == 2 else math.nan
    except ValueError:
        gbps = latency_us = math.nan
    if len(parts) != 2 or not (gbps > 0 and math.isfinite(gbps)) or not (latency_us >= 0 and math.isfinite(latency_us)):
        raise UserError(
            f"--link {spec}: unknown link; name one of {', '.join(LINKS)}, or give bandwidth and latency as GB/s,us (e.g. 1.25,30)"
        )
    return LinkCost(latency_us * 1e-6, 1 / (gbps * 1e9), f"given: {gbps:g} GB/s, {latency_us:g} us")
