"""GPU-only checks: NVML/GPM sampling, sync detection, pageable copies, launch-bound steps.

Skipped without a CUDA GPU; on one they run for real (nothing here is simulated). The scripts
in scripts/ plant one cause each at a line marked `# planted:`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import gpulab.monitor
from gpulab.cli import main
from gpulab.monitor.parent.sampler import GPM_METRICS, Sampler
from tests.monitor.reports import read_report

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SCRIPTS = Path(__file__).parent / "scripts"


def planted_site(script: str) -> str:
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if '# planted:' in line)}"


def profile(tmp_path: Path, script: str) -> dict:
    out = tmp_path / "prof"
    assert main(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / script)]) == 0
    return read_report(out)


def finding(report: dict, cause: str) -> dict:
    found = [f for f in report["findings"] if f["cause"] == cause]
    assert found, f"no {cause} finding in {[(f['cause'], f['share']) for f in report['findings']]}"
    return found[0]


def busy_gpu(stop: threading.Event) -> None:
    x = torch.randn(4096, 4096, device="cuda")
    while not stop.is_set():
        x = (x @ x).tanh_()
        torch.cuda.synchronize()


def test_nvml_samples_every_visible_gpu():
    stop = threading.Event()
    worker = threading.Thread(target=busy_gpu, args=(stop,))
    worker.start()
    # NVML's utilization is an average over its own sample period (up to 1 s): busy first, then
    # sample (on an H100 ten samples from the matmuls' first 0.5 s all read 0%)
    time.sleep(1.5)
    s = Sampler(interval_s=0.05).start()
    try:
        while len(s.samples) < 10:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join()
        s.stop()
    assert s.gpu.status == "ok" and s.gpu.gpus
    rows = [row["gpus"][0] for row in s.samples]
    assert all(r.get("kernel_active_pct") is not None and r.get("memory_used_mib", 0) > 0 for r in rows)
    assert max(r["kernel_active_pct"] for r in rows) > 0  # the matmuls ran while we sampled


def test_gpm_metrics_on_hopper_and_newer():
    major, _ = torch.cuda.get_device_capability(0)
    if major < 9:
        pytest.skip("GPM needs Hopper or newer")
    import pynvml

    pynvml.nvmlInit()
    try:
        supported = pynvml.nvmlGpmQueryDeviceSupport(pynvml.nvmlDeviceGetHandleByIndex(0)).isSupportedDevice
    finally:
        pynvml.nvmlShutdown()
    if not supported:
        pytest.skip("this driver does not expose GPM on this GPU")
    s = Sampler(interval_s=0.1).start()
    stop = threading.Event()
    worker = threading.Thread(target=busy_gpu, args=(stop,))
    worker.start()
    try:
        while len(s.samples) < 8:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join()
        s.stop()
    assert s.gpu.gpus[0]["gpm"] is True
    rows = [row["gpus"][0] for row in s.samples[1:]]  # GPM needs two samples for the first value
    for name in GPM_METRICS.values():
        assert any(r.get(name) is not None for r in rows), name
    assert max(r["sm_active_pct"] for r in rows if r.get("sm_active_pct") is not None) > 0


def test_per_step_item_is_a_host_sync_at_its_line(tmp_path):
    report = profile(tmp_path, "item_every_step.py")
    site = planted_site("item_every_step.py")
    syncs = [s for s in report["syncs"] if s["kind"] == "sync" and s["where"].endswith(site)]
    assert syncs and "Tensor.item" in syncs[0]["ops"] and syncs[0]["count"] >= 60
    f = finding(report, "host_sync")
    assert f["where"].endswith(site) and f["share"] >= 0.2
    assert report["findings"][0]["cause"] == "host_sync"
    assert report["cuda"]["sync_debug_mode"] is True
    assert "error" not in report["kernel_window"]


def test_pageable_copy_is_h2d_copy_at_its_line(tmp_path):
    report = profile(tmp_path, "pageable_copy.py")
    site = planted_site("pageable_copy.py")
    copies = [s for s in report["syncs"] if s["kind"] == "h2d_pageable"]
    assert copies and copies[0]["where"].endswith(site) and copies[0]["count"] >= 30
    f = finding(report, "h2d_copy")
    assert f["where"].endswith(site)


def test_pinned_copy_without_non_blocking_is_a_blocking_copy(tmp_path):
    report = profile(tmp_path, "pinned_blocking_copy.py")
    site = planted_site("pinned_blocking_copy.py")
    copies = [s for s in report["syncs"] if s["kind"] == "h2d_pinned_blocking"]
    assert copies and copies[0]["where"].endswith(site) and copies[0]["count"] >= 30
    f = finding(report, "h2d_copy")
    assert f["where"].endswith(site) and "non_blocking=True" in f["fix"]


def test_an_annotated_step_reads_like_the_same_step_unannotated(tmp_path):
    plain = profile(tmp_path / "plain", "item_every_step.py")
    annotated = profile(tmp_path / "annotated", "annotated_step.py")
    # record_function ranges on the GPU track span the step's kernels; counted as kernels they
    # would fill the idle gaps and hide the host sync.
    assert annotated["device_busy"]["share"] <= plain["device_busy"]["share"] + 0.05
    f = finding(annotated, "host_sync")
    assert f["where"].endswith(planted_site("annotated_step.py"))


def test_a_gpu_bound_loop_without_syncs_has_no_host_sync_finding(tmp_path):
    # Leaving torch.profiler synchronizes the device; that wait is gpulab's, not the script's.
    report = profile(tmp_path, "slow_loader_gpu.py")
    assert "host_sync" not in [f["cause"] for f in report["findings"]]
    assert report["kernel_window"]["runtime_sync_s_per_step"] < 0.001
    assert finding(report, "input_pipeline")["where"].endswith(planted_site("slow_loader_gpu.py"))


def test_many_tiny_kernels_are_launch_overhead(tmp_path):
    report = profile(tmp_path, "tiny_kernels.py")
    window = report["kernel_window"]
    assert "error" not in window and window["kernels_per_step"] >= 500 and window["kernel_median_us"] < 20
    finding(report, "launch_overhead")


def test_sync_inside_an_unwrapped_call_is_located(tmp_path):
    report = profile(tmp_path, "masked_index.py")
    site = planted_site("masked_index.py")
    untimed = [s for s in report["syncs"] if s["kind"] == "sync" and s["untimed"] and s["where"].endswith(site)]
    assert untimed and untimed[0]["untimed"] >= 20


def test_cpu_only_script_on_a_gpu_machine_is_cpu_only_torch(tmp_path):
    report = profile(tmp_path, "fast_dataset.py")
    assert report["cuda"]["initialized"] is False  # the profiler itself did not touch the GPU
    finding(report, "cpu_only_torch")


def test_a_profiled_cuda_job_ends_as_it_would_and_reads_as_the_gpu_job_it_is(tmp_path):
    # Issue 33: on an H200, 4 of 9 profiled CUDA scripts ended with SIGSEGV in a garbage collection.
    # The same loop as tests/monitor/test_profile_safety.py's, on the GPU: collections forced
    # often, a helper thread alive, gradients made and freed every step (200 steps took 63 s on an
    # H100; `scripts/gpu_check.py --repeat N` runs it N more times).
    out = tmp_path / "prof"
    done = subprocess.run([sys.executable, "-m", "gpulab", "profile", "--out", str(out), "--", sys.executable,
                           str(SCRIPTS / "gc_pressure.py"), "100", "cuda"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    told = next(line for line in done.stdout.splitlines() if line.startswith("TRUTH "))
    assert "most_weakrefs_on_tensors 0 most_finalizers_on_tensors 0" in told
    report = read_report(out)
    assert report["cuda"]["devices"] and "cpu_only_torch" not in [f["cause"] for f in report["findings"]]
    assert report["steps_found"] == "found from optimizer.step()"
    assert "error" not in report["memory"] and report["memory"]["device"].startswith("cuda")
    assert "error" not in report["kernel_window"]


def test_api_on_cuda_times_item_and_restores_sync_debug_mode(tmp_path):
    model = nn.Linear(256, 10).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    X, y = torch.randn(512, 256, device="cuda"), torch.randint(0, 10, (512,), device="cuda")
    with gpulab.monitor.profile(out=tmp_path, quiet=True) as p:
        for _ in range(12):
            loss = nn.functional.cross_entropy(model(X), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            loss.item()
    items = [s for s in p.report["syncs"] if "Tensor.item" in s["ops"]]
    assert items and items[0]["count"] == 12 and items[0]["seconds"] > 0
    assert torch.cuda.get_sync_debug_mode() == 0
    assert "item" not in vars(torch.Tensor)


def test_a_cuda_graph_skipped_for_a_mutated_input_is_named_with_its_fix(tmp_path):
    report = profile(tmp_path, "compile_cudagraph_skip.py")
    skips = [f for f in report["findings"] if f["cause"] == "cudagraph_skip"]
    assert skips and "mutated input" in skips[0]["evidence"] and "in place" in skips[0]["fix"]
    # the line that writes into the input, and the compiled function's call in the script
    lines = (SCRIPTS / "compile_cudagraph_skip.py").read_text().splitlines()
    planted = next(i for i, line in enumerate(lines, 1) if "# planted:" in line)
    call = next(i for i, line in enumerate(lines, 1) if "loss = loss_of(x, y)" in line)
    assert re.search(rf"x\.mul_\(0\.5\) at \S*compile_cudagraph_skip\.py:{planted}\b", skips[0]["evidence"]), skips
    assert skips[0]["where"].endswith(f"compile_cudagraph_skip.py:{call}"), skips


def test_a_cuda_graph_recorded_again_for_a_weight_in_new_memory_is_named_with_its_fix(tmp_path):
    # the weight gets new memory 3 times in 20 steps: its graphs (forward, backward) are recorded again
    report = profile(tmp_path, "compile_cudagraph_rerecord.py")
    again = [f for f in report["findings"] if f["cause"] == "cudagraph_rerecord"]
    assert again and "data pointer changed" in again[0]["evidence"] and "in place" in again[0]["fix"], report["findings"]


def test_replays_of_a_recorded_whole_step_are_the_steps(tmp_path):
    # one optimizer step recorded inside torch.cuda.graph, never called again from Python: each
    # replay is a training step (a loop the profiler would otherwise see as one endless step)
    report = profile(tmp_path, "whole_step_graph.py")
    # 3 warm-up steps, the recording (no step: nothing ran), 200 replays
    assert report["steps"] == 203 and report["steps_found"] == "found from optimizer.step()", report["steps"]
    assert report["steady_steps"] >= 150 and report["step_time_s"]["median"] < 0.05
