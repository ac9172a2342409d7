"""The user's lines that made the host wait: syncs and host-to-device copies, per line, whole run,
and how much of it came once the loop was past its warm-up: a finding about the steps points at
the line the steps wait at, not at a set-up call (the model's one `.to(device)`, which also pays
for CUDA's start-up, outweighs a per-step copy in seconds over a short run)."""

from __future__ import annotations


class SyncSites:
    """Per (kind, file:line): which ops, how many calls, seconds, untimed syncs and bytes; the
    calls and seconds in the steps after the warm-up (`steady_count`, `steady_seconds`)."""

    def __init__(self, warmup_steps: int):
        self._sites: dict[str, dict] = {}
        self.warmup_steps = warmup_steps

    def note(self, kind: str, op: str, where: str | None, steps_done: int, seconds: float = 0.0, untimed: int = 0,
             nbytes: int = 0) -> None:
        key = f"{kind}|{where}"
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = {"kind": kind, "where": where, "ops": [], "count": 0, "seconds": 0.0,
                                       "untimed": 0, "bytes": 0, "steady_count": 0, "steady_seconds": 0.0}
        if op not in site["ops"]:
            site["ops"].append(op)
        site["count"] += 1
        site["seconds"] += seconds
        site["untimed"] += untimed
        site["bytes"] += nbytes
        if steps_done >= self.warmup_steps:
            site["steady_count"] += 1
            site["steady_seconds"] += seconds

    def snapshot(self) -> dict:
        return {"type": "sites", "sites": list(self._sites.values())}
