"""The user's lines that made the host wait: syncs and host-to-device copies, per line, whole run."""

from __future__ import annotations


class SyncSites:
    """Per (kind, file:line): which ops, how many calls, seconds, untimed syncs and bytes."""

    def __init__(self):
        self._sites: dict[str, dict] = {}

    def note(self, kind: str, op: str, where: str | None, seconds: float = 0.0, untimed: int = 0,
             nbytes: int = 0) -> None:
        key = f"{kind}|{where}"
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = {"kind": kind, "where": where, "ops": [], "count": 0,
                                       "seconds": 0.0, "untimed": 0, "bytes": 0}
        if op not in site["ops"]:
            site["ops"].append(op)
        site["count"] += 1
        site["seconds"] += seconds
        site["untimed"] += untimed
        site["bytes"] += nbytes

    def snapshot(self) -> dict:
        return {"type": "sites", "sites": list(self._sites.values())}
