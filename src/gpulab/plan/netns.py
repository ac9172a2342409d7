"""Two test hosts on this machine: network namespaces joined by a veth pair whose rate is
limited with `tc` (a token bucket filter on each end), so that bytes between ranks really cost
what a slow link costs. Made for one measurement and removed after it; root only.

This kernel may lack netem, so a link gets a rate but no added delay: the latency is the
network stack's own.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager

from gpulab.errors import UserError
from gpulab.plan.collective import Host

SUBNET = "10.231.{n}.{host}"


def available() -> str | None:
    """None when test hosts can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces and tc); run as root or leave out the 2-host check"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"test hosts need `{tool}` (iproute2): apt-get install iproute2"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise UserError(f"`{' '.join(args)}` failed: {done.stderr.strip() or done.returncode}")


@contextmanager
def test_hosts(rate_mbit: float, count: int = 2):
    """`count` hosts (namespaces) on one switch-less link of `rate_mbit` Mbit/s each way.
    Yields their `Host`s; rank r runs on host r. Only two hosts are supported (one veth pair)."""
    if count != 2:
        raise UserError("test hosts: only 2 are supported (one veth pair)")
    why = available()
    if why:
        raise UserError(why)
    tag = f"{os.getpid() % 100000}"
    names = [f"gpulab-{tag}-{i}" for i in range(count)]
    veths = [f"gpl{tag}{'ab'[i]}" for i in range(count)]
    n = os.getpid() % 250 + 1
    addresses = [SUBNET.format(n=n, host=i + 1) for i in range(count)]
    try:
        for name in names:
            _ip("ip", "netns", "add", name)
        _ip("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for name, veth, address in zip(names, veths, addresses):
            _ip("ip", "link", "set", veth, "netns", name)
            _ip("ip", "-n", name, "addr", "add", f"{address}/24", "dev", veth)
            _ip("ip", "-n", name, "link", "set", veth, "up")
            _ip("ip", "-n", name, "link", "set", "lo", "up")
            _ip("tc", "-n", name, "qdisc", "add", "dev", veth, "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                "burst", "64kb", "latency", "50ms")
        yield [Host(prefix=["ip", "netns", "exec", name], env={"GLOO_SOCKET_IFNAME": veth}, address=addresses[0])
               for name, veth in zip(names, veths)]
    finally:
        for name in names:  # deleting a namespace deletes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
