"""timeline.png and trace.json from hand-made recordings, including GPU rows (with the metrics a
driver may not give as None), so the plotting code for GPU runs is exercised on any machine."""

from __future__ import annotations

import json

from gpulab.io import OutputFolder
from gpulab.monitor.output import timeline, trace
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import Recording
from gpulab.monitor.output.report import build_report, terminal_lines, write_outputs

GPU = {"index": 0, "name": "Test GPU", "uuid": "GPU-1234", "memory_total_mib": 80000.0, "gpm": True}


def recording() -> Recording:
    records = [{"type": "start", "t": 10.0, "pid": 42, "command": ["train.py"], "torch": "2.x",
                "torch_cuda_build": "12.6", "cpu_count": 16, "torch_threads": 8}]
    t = 10.5
    for i in range(30):
        records.append({"type": "step", "i": i, "t0": t, "t1": t + 0.01, "profiled": 2 <= i < 5,
                        "excl": {"data_wait": 0.002, "h2d": 0.0, "compute": 0.003, "sync": 0.004, "other": 0.001},
                        "counts": {"sync": 1}, "data": [[t, t + 0.002]],
                        "spans": [["next(DataLoader)", "data_wait", t, t + 0.002], ["Net", "compute", t + 0.002, t + 0.005],
                                  ["sync: Tensor.item", "sync", t + 0.005, t + 0.009]]})
        t += 0.01
    records += [
        {"type": "tail", "t0": t, "t1": t + 0.05, "excl": {"other": 0.05}, "counts": {}, "profiled": False, "data": []},
        {"type": "sites", "sites": [{"kind": "sync", "where": "train.py:9", "ops": ["Tensor.item"], "count": 30,
                                     "seconds": 0.12, "untimed": 0, "bytes": 0}]},
        {"type": "end", "t": t + 0.05, "exit_code": 0, "error": None,
         "cuda": {"available": True, "initialized": True, "devices": [{"uuid": "1234"}]}},
    ]
    return Recording(records)


def samples() -> list[dict]:
    rows = []
    for k in range(8):
        gpu = {"kernel_active_pct": 50.0 + k, "memory_busy_pct": 10.0, "memory_used_mib": 2048.0, "power_w": None,
               "sm_clock_mhz": 1980.0, "pcie_tx_mb_s": 1.0, "pcie_rx_mb_s": 900.0,
               "sm_active_pct": None if k == 0 else 30.0, "sm_occupancy_pct": 20.0, "tensor_active_pct": None,
               "dram_bw_pct": 5.0}
        proc = {"cpu_pct": 100.0, "rss_mib": 900.0, "threads": 12, "workers": 2, "workers_cpu_pct": 150.0,
                "workers_rss_mib": 800.0}
        rows.append({"t": 10.4 + 0.05 * k, "gpus": [gpu], "proc": proc})
    return rows


def test_gpu_run_outputs_render(tmp_path):
    rec = recording()
    report, _ = build_report([rec], rec.pid, samples(), [GPU], {"interval_s": 0.05}, ProfileConfig(), exit_code=0)
    write_outputs(OutputFolder.out(tmp_path), report, [rec], samples(), [GPU], title="train.py")
    assert (tmp_path / "timeline.png").read_bytes()[:4] == b"\x89PNG"
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"GPU0 utilization %", "GPU0 memory used MiB", "CPU % (100 = one core)"} <= counters
    assert any(e["name"] == "sync: Tensor.item" for e in events)
    gpu = report["devices"][0]
    assert gpu["used_by_script"] and gpu["mean"]["kernel_active_pct"] > 0 and "power_w" not in gpu["mean"]
    assert report["excluded_steps"]["profiler_window"] == 3
    assert any("host_sync" in line or "no bottleneck" in line for line in terminal_lines(report, tmp_path))


def test_time_origin_is_the_earliest_clock_reading():
    assert timeline.time_origin([recording()], samples()) == 10.0
    assert trace.build([recording()], [], [], 10.0)["traceEvents"][0]["ph"] == "M"


def cpu_recording(steps: int = 1000, start_up_s: float = 5.0) -> Recording:
    """A CPU run: a long start-up, then many short steps with a 2% data wait and some .to() time."""
    records = [{"type": "start", "t": 0.0, "pid": 7, "command": ["train.py"], "torch": "2.x", "torch_cuda_build": None,
                "cpu_count": 2, "torch_threads": 2}]
    t = start_up_s
    for i in range(steps):
        records.append({"type": "step", "i": i, "t0": t, "t1": t + 0.01, "profiled": False,
                        "excl": {"data_wait": 0.0002, "h2d": 0.0005, "compute": 0.009, "other": 0.0003},
                        "counts": {}, "data": [[t, t + 0.0002]], "spans": []})
        t += 0.01
    records.append({"type": "end", "t": t, "exit_code": 0, "error": None, "cuda": {"available": False}})
    return Recording(records)


def cpu_samples(until: float) -> list[dict]:
    proc = {"cpu_pct": 190.0, "rss_mib": 500.0, "threads": 4, "workers": 0, "workers_cpu_pct": 0.0, "workers_rss_mib": 0.0}
    return [{"t": 0.25 * k, "gpus": [], "proc": proc} for k in range(int(until / 0.25))]


def test_a_cpu_timeline_a_person_can_read():
    rec = cpu_recording()
    report, _ = build_report([rec], rec.pid, cpu_samples(15.0), [], {"interval_s": 0.25}, ProfileConfig(), exit_code=0)
    fig = timeline.figure([rec], cpu_samples(15.0), [], report, "train.py")
    fig.canvas.draw()
    steps_ax = fig.axes[0]
    labels = steps_ax.get_legend_handles_labels()[1]
    assert "compute" in labels and "data wait" in labels
    assert not any("host-to-device" in label for label in labels)  # no such thing without a GPU
    for ax in fig.axes:  # legends beside the data, never on it
        legend = ax.get_legend()
        if legend is not None:
            assert legend.get_window_extent().x0 >= ax.get_window_extent().x1
    # The 5 s start-up is said, not drawn: the axis starts just before the first step.
    assert 4.5 < steps_ax.get_xlim()[0] < 5.0
    assert "first 5.0 s, start-up" in fig.axes[-1].get_xlabel()
    # 1000 data waits become one strip of binned shades at the bottom of each row, not 1000 spans.
    strip = [c for c in fig.axes[1].collections if "waiting for data" in str(c.get_label())]
    assert len(strip) == 1 and len(strip[0].get_paths()) <= timeline.STRIP_BINS


def test_a_gpu_timeline_names_host_to_device_copies():
    rec = cpu_recording(steps=50, start_up_s=0.01)
    gpu_samples = [{**s, "gpus": [{"kernel_active_pct": 40.0, "memory_used_mib": 1024.0}]} for s in cpu_samples(1.0)]
    report, _ = build_report([rec], rec.pid, gpu_samples, [GPU], {"interval_s": 0.25}, ProfileConfig(), exit_code=0)
    fig = timeline.figure([rec], gpu_samples, [GPU], report, "train.py")
    assert "host-to-device copy" in fig.axes[0].get_legend_handles_labels()[1]
    assert fig.axes[0].get_xlim()[0] == 0  # a short start-up is drawn
