"""trace.json: a Chrome trace-event file (open it in ui.perfetto.dev or chrome://tracing).

One process track for the training script (steps; the spans inside each step: data waits,
forward, backward, optimizer, syncs and copies) and one for the sampled devices, whose readings
are counter tracks (GPU utilization, memory, CPU %). Times are microseconds since the script
started, on the same clock as timeline.png.
"""

from __future__ import annotations

from gpulab.monitor.events import Recording

_SCRIPT, _DEVICES = 1, 2
_STEPS_TID, _SPANS_TID = 1, 2


def build(rec: Recording, samples: list[dict], gpus: list[dict], origin: float) -> dict:
    def us(t: float) -> float:
        return round((t - origin) * 1e6, 1)

    events: list[dict] = [
        _meta("process_name", _SCRIPT, 0, f"training script (pid {rec.start.get('pid', '?')})"),
        _meta("thread_name", _SCRIPT, _STEPS_TID, "steps"),
        _meta("thread_name", _SCRIPT, _SPANS_TID, "phases (host)"),
        _meta("process_name", _DEVICES, 0, "sampled: GPUs and process"),
    ]
    for s in rec.steps:
        events.append({
            "name": f"step {s['i']}", "cat": "step", "ph": "X", "pid": _SCRIPT, "tid": _STEPS_TID,
            "ts": us(s["t0"]), "dur": round((s["t1"] - s["t0"]) * 1e6, 1),
            "args": {f"{k} ms": round(v * 1e3, 3) for k, v in s["excl"].items()} | {"excluded": bool(s.get("profiled"))},
        })
    if rec.tail:
        events.append({
            "name": "after the last step", "cat": "step", "ph": "X", "pid": _SCRIPT, "tid": _STEPS_TID,
            "ts": us(rec.tail["t0"]), "dur": round((rec.tail["t1"] - rec.tail["t0"]) * 1e6, 1),
        })
    for s in [*rec.steps, *([rec.tail] if rec.tail else [])]:
        for name, category, t0, t1 in s.get("spans", []):
            events.append({
                "name": name, "cat": category, "ph": "X", "pid": _SCRIPT, "tid": _SPANS_TID,
                "ts": us(t0), "dur": round((t1 - t0) * 1e6, 1),
            })
    for sample in samples:
        ts = us(sample["t"])
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
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _counter(events: list[dict], name: str, ts: float, values: dict) -> None:
    args = {k: round(v, 3) for k, v in values.items() if v is not None}
    if args:
        events.append({"name": name, "ph": "C", "pid": _DEVICES, "tid": 0, "ts": ts, "args": args})
