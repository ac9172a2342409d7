"""trace.json: a Chrome trace-event file (open it in ui.perfetto.dev or chrome://tracing).

A process track per training process (its steps, and the spans inside each: data waits,
transforms, forward, backward, optimizer, syncs and copies), and one for the sampled devices as
counter tracks. Times are microseconds since the script started, as in timeline.png. Bounded
whatever the run's length: spans for the first trace_steps steps, whole steps up to the detailed
window (detail_steps), then an event per block of summed steps.
"""

from __future__ import annotations

from gpulab.monitor.events import Recording

_DEVICES, _FIRST_LANE = 1, 2
_STEPS_TID, _SPANS_TID = 1, 2


def build(lanes: list[Recording], samples: list[dict], gpus: list[dict], origin: float) -> dict:
    events: list[dict] = [_meta("process_name", _DEVICES, 0, "sampled: GPUs and process")]
    for n, rec in enumerate(lanes):
        events += _lane_events(rec, _FIRST_LANE + n, origin)
    events += _sample_events(samples, gpus, origin)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _lane_events(rec: Recording, track: int, origin: float) -> list[dict]:
    name = f"rank {rec.rank}" if rec.rank is not None else "training process"
    events: list[dict] = [
        _meta("process_name", track, 0, f"{name} (pid {rec.pid or '?'})"),
        _meta("process_sort_index", track, 0, track),
        _meta("thread_name", track, _STEPS_TID, "steps"),
        _meta("thread_name", track, _SPANS_TID, "phases (host)"),
    ]
    for s in rec.steps:
        args = {f"{k} ms": round(v * 1e3, 3) for k, v in s["excl"].items()} | {"excluded": bool(s.get("profiled"))}
        events.append(_span(f"step {s['i']}", "step", track, _STEPS_TID, s["t0"], s["t1"], origin, args))
    for b in rec.blocks:
        args = {f"{k} ms per step": round(v * 1e3 / b["n"], 4) for k, v in b["excl"].items()} | {"steps": b["n"]}
        events.append(_span(f"steps {b['i0']}-{b['i1']} (summed)", "steps", track, _STEPS_TID, b["t0"], b["t1"], origin,
                            args))
    if rec.tail:
        events.append(_span("after the last step", "step", track, _STEPS_TID, rec.tail["t0"], rec.tail["t1"], origin))
    for s in [*rec.steps, *([rec.tail] if rec.tail else [])]:
        for name, category, t0, t1 in s.get("spans", []):
            events.append(_span(name, category, track, _SPANS_TID, t0, t1, origin))
    return events


def _sample_events(samples: list[dict], gpus: list[dict], origin: float) -> list[dict]:
    events: list[dict] = []
    for sample in samples:
        ts = _us(sample["t"], origin)
        for position, info in enumerate(gpus):
            if position >= len(sample["gpus"]):
                continue
            row = sample["gpus"][position]
            name = f"GPU{info['index']}"
            _counter(events, f"{name} utilization %", ts, {
                "kernel active (NVML)": row.get("kernel_active_pct"),
                "SM active (GPM)": row.get("sm_active_pct"),
                "tensor active (GPM)": row.get("tensor_active_pct"),
                "DRAM bandwidth (GPM)": row.get("dram_bw_pct"),
            })
            _counter(events, f"{name} memory used MiB", ts, {"used": row.get("memory_used_mib")})
            _counter(events, f"{name} PCIe MB/s", ts, {"tx": row.get("pcie_tx_mb_s"), "rx": row.get("pcie_rx_mb_s")})
            _counter(events, f"{name} power W", ts, {"power": row.get("power_w")})
        proc = sample.get("proc")
        if proc:
            cpu = {"training process": proc["cpu_pct"], "workers": proc["workers_cpu_pct"]}
            _counter(events, "CPU % (100 = one core)", ts, cpu)
            _counter(events, "RSS MiB", ts, {"training process": proc["rss_mib"], "workers": proc["workers_rss_mib"]})
    return events


def _us(t: float, origin: float) -> float:
    """Microseconds since `origin`: the trace's clock."""
    return round((t - origin) * 1e6, 1)


def _span(name: str, category: str, track: int, tid: int, t0: float, t1: float, origin: float,
          args: dict | None = None) -> dict:
    """A complete event: t0..t1 on a thread of a process track."""
    event = {"name": name, "cat": category, "ph": "X", "pid": track, "tid": tid, "ts": _us(t0, origin),
             "dur": round((t1 - t0) * 1e6, 1)}
    return event | {"args": args} if args is not None else event


def _meta(kind: str, pid: int, tid: int, value) -> dict:
    key = "sort_index" if kind.endswith("sort_index") else "name"
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def _counter(events: list[dict], name: str, ts: float, values: dict) -> None:
    args = {k: round(v, 3) for k, v in values.items() if v is not None}
    if args:
        events.append({"name": name, "ph": "C", "pid": _DEVICES, "tid": 0, "ts": ts, "args": args})
