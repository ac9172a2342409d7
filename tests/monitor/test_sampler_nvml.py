"""GpuReader's NVML paths on a fake `pynvml`, so they run without a GPU.

The shapes faked here are NVML's, as read on a real H100 (driver 580.159.04, nvidia-ml-py 13.610,
2026-11-24): nvmlDeviceGetProcessUtilization(handle, lastSeenTimeStamp) returned
[{pid: 464, smUtil: 52, memUtil: 3, timeStamp: 1795484410225235}] (nvml.h:
nvmlProcessUtilizationSample_t; timeStamp in microseconds; NVML_ERROR_NOT_FOUND when no process
has a sample newer than lastSeenTimeStamp), and a GPM metrics request returns one
{metricId, value, nvmlReturn} per metric asked for (nvml.h: nvmlGpmMetricsGet_t). NVML's GPM
documentation asks for the two samples of a pair to be more than 100 ms apart.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from gpulab.monitor.parent import sampler as sampler_module
from gpulab.monitor.parent.sampler import GPM_FAILURES_BEFORE_OFF, GPM_MIN_GAP_S, GpuReader
from tests.hardware.fake_nvml import A100, FakeGpu, machine

NOT_SUPPORTED, NOT_FOUND, NO_PERMISSION, FUNCTION_NOT_FOUND = 3, 6, 4, 13


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_pynvml(process_samples=None, gpm_ok=lambda: True) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVMLError = FakeNVMLError
    nv.NVML_SUCCESS = 0
    nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_NOT_FOUND = NOT_SUPPORTED, NOT_FOUND
    nv.NVML_ERROR_NO_PERMISSION, nv.NVML_ERROR_FUNCTION_NOT_FOUND = NO_PERMISSION, FUNCTION_NOT_FOUND
    nv.NVML_GPM_METRICS_GET_VERSION = 1
    nv.gpm_sample_gets = 0

    def unsupported(*args):
        raise FakeNVMLError(NOT_SUPPORTED)

    nv.nvmlInit = nv.nvmlShutdown = lambda: None
    nv.nvmlDeviceGetCount = lambda: 1
    nv.nvmlDeviceGetHandleByIndex = lambda i: f"handle{i}"
    nv.nvmlDeviceGetName = lambda h: "NVIDIA H100 80GB HBM3"
    nv.nvmlDeviceGetUUID = lambda h: "GPU-0db07a0e-dc2d-4caa-5b67-461cdb9ae06e"
    nv.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=85520809984, used=1533870080, free=83986939904)
    nv.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=40, memory=5)
    nv.nvmlDeviceGetPowerUsage = nv.nvmlDeviceGetClockInfo = nv.nvmlDeviceGetFieldValues = unsupported
    nv.nvmlDeviceGetPcieThroughput = unsupported
    nv.NVML_CLOCK_SM = nv.NVML_PCIE_UTIL_TX_BYTES = nv.NVML_PCIE_UTIL_RX_BYTES = 0
    nv.nvmlGpmQueryDeviceSupport = lambda h: SimpleNamespace(isSupportedDevice=1)
    nv.nvmlGpmSampleAlloc = lambda: object()
    nv.nvmlGpmSampleFree = lambda s: None

    def sample_get(h, s):
        nv.gpm_sample_gets += 1

    nv.nvmlGpmSampleGet = sample_get

    class MetricsGet:
        def __init__(self):
            self.metrics = [SimpleNamespace(metricId=0, value=0.0, nvmlReturn=0) for _ in range(98)]

    nv.c_nvmlGpmMetricsGet_t = MetricsGet

    def metrics_get(request):
        ok = gpm_ok()
        for m in request.metrics[: request.numMetrics]:
            m.value, m.nvmlReturn = (50.0, 0) if ok else (0.0, NOT_SUPPORTED)

    nv.nvmlGpmMetricsGet = metrics_get

    def process_utilization(h, last_seen_us):
        found = [s for s in (process_samples or []) if s.timeStamp > last_seen_us]
        if not found:
            raise FakeNVMLError(NOT_FOUND)
        return found

    nv.nvmlDeviceGetProcessUtilization = process_utilization
    return nv


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(sampler_module.time, "monotonic", c)
    return c


def test_gpm_pairs_are_never_closer_than_nvml_allows_whatever_the_interval(monkeypatch, clock):
    nv = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reader = GpuReader()
    gpm_rows = 0
    for _ in range(40):  # 40 reads 20 ms apart = 0.8 s
        row = reader.read()[0]
        gpm_rows += "sm_active_pct" in row
        clock.now += 0.02
    reader.close()
    # One GPM sample per GPM_MIN_GAP_S of the 0.8 s, not one per read (the first only opens a pair).
    assert nv.gpm_sample_gets == pytest.approx(0.8 / GPM_MIN_GAP_S, abs=1)
    assert gpm_rows == nv.gpm_sample_gets - 1


def test_one_failed_gpm_read_does_not_switch_gpm_off(monkeypatch, clock):
    results = iter([True, False, True, True])  # the second pair fails once, then GPM works again
    nv = fake_pynvml(gpm_ok=lambda: next(results))
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reader = GpuReader()
    rows = []
    for _ in range(5):
        rows.append(reader.read()[0])
        clock.now += GPM_MIN_GAP_S + 0.001
    assert rows[-1].get("sm_active_pct") == 50.0
    assert "gpm" not in reader.unsupported().get(0, [])


def test_gpm_that_keeps_failing_is_switched_off(monkeypatch, clock):
    nv = fake_pynvml(gpm_ok=lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reader = GpuReader()
    for _ in range(GPM_FAILURES_BEFORE_OFF + 3):
        reader.read()
        clock.now += GPM_MIN_GAP_S + 0.001
    assert "gpm" in reader.unsupported()[0]
    assert nv.gpm_sample_gets == GPM_FAILURES_BEFORE_OFF + 1  # no more reads once switched off


def test_the_job_s_sm_share_counts_only_its_own_processes(monkeypatch):
    samples = [SimpleNamespace(pid=464, smUtil=52, memUtil=3, timeStamp=1795484410225235),
               SimpleNamespace(pid=464, smUtil=48, memUtil=3, timeStamp=1795484410392000),
               SimpleNamespace(pid=470, smUtil=20, memUtil=1, timeStamp=1795484410392000),   # a worker of the job
               SimpleNamespace(pid=9999, smUtil=90, memUtil=9, timeStamp=1795484410392000)]  # someone else
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(process_samples=samples))
    reader = GpuReader(job_pids=lambda: {464, 470})
    first, second = reader.read()[0], reader.read()[0]
    assert first["process_sm_pct"] == pytest.approx(50 + 20)  # mean per process, summed over the job
    assert first["kernel_active_pct"] == 40.0  # the device-wide figure is kept beside it
    assert second["process_sm_pct"] == 0.0  # nothing newer than the last sample seen: NVML_ERROR_NOT_FOUND


# ----------------------------------------------------------------------------- which GPUs


def _sampled(monkeypatch, visible) -> list[int]:
    instance = FakeGpu(name="NVIDIA H100 80GB HBM3 MIG 3g.40gb", uuid="MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee")
    machine(monkeypatch, [FakeGpu(), FakeGpu(uuid=A100.uuid, mig_mode=[1, 1], mig=[instance, None])], visible=visible)
    reader = GpuReader()
    try:
        rows = reader.read()
        assert len(rows) == len(reader.gpus) and all(row["kernel_active_pct"] == 37.0 for row in rows)
        return [g["index"] for g in reader.gpus]
    finally:
        reader.close()


def test_a_selected_mig_instance_samples_its_gpu(monkeypatch):
    # NVML gives utilization per GPU, not per MIG instance: the instance's GPU is the one sampled.
    assert _sampled(monkeypatch, "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee") == [1]
    assert _sampled(monkeypatch, "MIG-aaaa,0") == [1, 0]


@pytest.mark.parametrize(
    "visible, sampled",
    [(None, [0, 1]), ("1,0", [1, 0]), ("GPU-1111", [1]), ("0,7,1", [0]), ("0,0", []), ("GPU-,1", [])],
)
def test_the_sampler_reads_cuda_visible_devices_as_gpulab_devices_does(monkeypatch, visible, sampled):
    assert _sampled(monkeypatch, visible) == sampled


def test_each_gpu_s_facts_are_read_once_and_its_readings_every_sample(monkeypatch):
    nv = machine(monkeypatch, [FakeGpu(), A100])
    reader = GpuReader()
    rows = [reader.read() for _ in range(3)]
    reader.close()
    assert [(g["index"], g["name"], g["uuid"]) for g in reader.gpus] == [(0, FakeGpu().name, FakeGpu().uuid),
                                                                         (1, A100.name, A100.uuid)]
    assert all(row["memory_used_mib"] == 1024 for sample in rows for row in sample)
    assert nv.calls["nvmlDeviceGetName"] == nv.calls["nvmlDeviceGetUUID"] == 2  # once per GPU
    assert nv.calls["nvmlDeviceGetMemoryInfo"] == 2 + 3 * 2  # the total once, what is in use each sample
    assert nv.calls["nvmlDeviceGetUtilizationRates"] == 3 * 2


def test_pcie_rates_come_from_the_byte_counters_when_nvml_has_them(monkeypatch):
    nv = fake_pynvml()
    counts = iter(range(1, 100))

    def field_values(h, ids):
        n = next(counts)
        return [SimpleNamespace(nvmlReturn=nv.NVML_SUCCESS, value=SimpleNamespace(ullVal=n * 10**6)) for _ in ids]

    nv.nvmlDeviceGetFieldValues = field_values
    nv.nvmlDeviceGetPcieThroughput = lambda *a: pytest.fail("the 20 ms PCIe API is only a fallback")
    monkeypatch.setitem(sys.modules, "pynvml", nv)
    reader = GpuReader()
    first, second = reader.read()[0], reader.read()[0]
    reader.close()
    assert "pcie_tx_mb_s" not in first  # a rate needs two counts
    assert second["pcie_tx_mb_s"] > 0 and second["pcie_rx_mb_s"] > 0
    assert "pcie" not in reader.unsupported().get(0, [])
