"""The one reader of NVML's facts about the GPUs, for `gpulab devices` and the profiler's sampler.
Torch-free: the profiler's parent process samples the GPUs with it.

Every NVML query gpulab makes (besides starting NVML, nvml.py) is written here, and each runs
through `nvml.Queries`, the one funnel and error policy:
- the driver's facts and the GPU count: `read_driver`, `list_gpus`;
- `NvmlGpu`, one GPU: its handle, read when it is listed; its static facts (name, UUID, total
  memory, MIG instances, which optional counters it has), each read once, when first asked for,
  through the GPU's own `queries`, so that what failed there is that GPU's problem;
- its changing readings (memory in use, utilization, temperature, power, clock, PCIe traffic, the
  processes' utilization, GPM), read on request. They raise NVML's errors: each caller reads them
  through a `Queries` of its own, because each decides what a refused reading means to it (the
  sampler drops that metric from its samples; `gpulab devices` shows n/a and a problem).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

from gpulab.hardware.nvml import Queries

MIG_ENABLED = 1  # nvmlDeviceGetMigMode returns [current, pending]; 1 is NVML_DEVICE_MIG_ENABLE

# NVML field ids of the cumulative PCIe byte counters (nvml.h).
FI_PCIE_TX_BYTES = 197
FI_PCIE_RX_BYTES = 198


def as_str(x) -> str:
    """NVML's strings: bytes from older nvidia-ml-py, str from newer."""
    return x.decode() if isinstance(x, bytes) else str(x)


# ----------------------------------------------------------------------------- the driver


def read_driver(q: Queries) -> tuple[str | None, tuple[int, int] | None]:
    """The driver's version ('580.159.04') and the newest CUDA it supports ((13, 0)); None for
    what NVML did not say."""
    nv = q.nv
    version = q.query("driver version", lambda: as_str(nv.nvmlSystemGetDriverVersion()))
    cuda = q.query("driver's CUDA version", lambda: nv.nvmlSystemGetCudaDriverVersion())
    if not cuda:
        return version, None
    return version, (cuda // 1000, (cuda % 1000) // 10)  # 13000 -> (13, 0), 12040 -> (12, 4)


def list_gpus(q: Queries) -> list[NvmlGpu]:
    """Every GPU NVML knows, in NVML's (PCI) order, each with its handle; none when NVML cannot
    count them (`q` says why, under 'GPU count')."""
    nv = q.nv
    count = q.query("GPU count", lambda: nv.nvmlDeviceGetCount())
    return [NvmlGpu(nv, index) for index in range(count or 0)]


# ----------------------------------------------------------------------------- one GPU


class NvmlGpu:
    """One GPU as NVML numbers it. Static facts are attributes, read once; readings are methods,
    read on each call (see the module's docstring)."""

    def __init__(self, nv, index: int):
        self.nv = nv
        self.index = index  # NVML's number, as nvidia-smi shows it
        self.queries = Queries(nv)  # the static facts' queries: what failed there is this GPU's problem
        self.handle = self.queries.query("handle", lambda: nv.nvmlDeviceGetHandleByIndex(index))

    def _fact(self, what: str, read):
        """A static fact, read through this GPU's queries; None when the GPU has no handle."""
        return None if self.handle is None else self.queries.query(what, read)

    # --------------------------------------------------------------- static facts

    @cached_property
    def name(self) -> str | None:
        return self._fact("name", lambda: as_str(self.nv.nvmlDeviceGetName(self.handle)))

    @cached_property
    def uuid(self) -> str | None:
        """'GPU-0db07a0e-…', as CUDA_VISIBLE_DEVICES names it (torch prints it bare)."""
        return self._fact("uuid", lambda: as_str(self.nv.nvmlDeviceGetUUID(self.handle)))

    @cached_property
    def memory_total_mib(self) -> float | None:
        return self._fact("memory total", lambda: self.nv.nvmlDeviceGetMemoryInfo(self.handle).total / 2**20)

    @cached_property
    def mig_instances(self) -> list[NvmlMigInstance] | None:
        """The GPU's MIG instances (what torch sees instead of the GPU), or None when it is not in
        MIG mode."""
        if self.handle is None:
            return None
        handles = self._mig_instance_handles()
        return None if handles is None else [NvmlMigInstance(self.queries, h) for h in handles]

    def _mig_instance_handles(self) -> list | None:
        nv, q, handle = self.nv, self.queries, self.handle
        mode = q.query("MIG mode", lambda: nv.nvmlDeviceGetMigMode(handle))  # unsupported on GPUs without MIG
        if mode is None or mode[0] != MIG_ENABLED:
            return None
        slots = q.query("MIG slots", lambda: nv.nvmlDeviceGetMaxMigDeviceCount(handle)) or 0
        # An empty slot is NOT_FOUND (fewer instances exist than could): skipped, not a problem.
        found = [q.query(f"MIG slot {s}", lambda: nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, s))
                 for s in range(slots)]
        return [h for h in found if h is not None]

    @cached_property
    def has_pcie_counters(self) -> bool:
        """NVML gives this GPU's cumulative PCIe byte counters (a cheap read), not only the
        sampled throughput that blocks ~20 ms per call."""
        return bool(self._fact("PCIe counters", lambda: self.pcie_byte_counts() is not None))

    def open_gpm(self) -> GpmPair | None:
        """A pair of GPM sample buffers for this GPU, or None where it has no GPM (older GPUs and
        drivers). Not a cached fact: it allocates, and its owner frees it (`GpmPair.close`)."""

        def supported_pair() -> GpmPair | None:
            if not self.nv.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                return None
            return GpmPair(self.nv, self.handle)

        return self._fact("GPM", supported_pair)

    # --------------------------------------------------------------- readings (raise NVML's errors)

    def memory_used_mib(self) -> float:
        return self.nv.nvmlDeviceGetMemoryInfo(self.handle).used / 2**20

    def utilization_pct(self) -> tuple[int, int]:
        """NVML's (gpu, memory) utilization: the share of the last period in which at least one
        kernel ran, and in which device memory was read or written."""
        rates = self.nv.nvmlDeviceGetUtilizationRates(self.handle)
        return rates.gpu, rates.memory

    def temperature_c(self) -> int:
        return self.nv.nvmlDeviceGetTemperature(self.handle, self.nv.NVML_TEMPERATURE_GPU)

    def power_w(self) -> float:
        return self.nv.nvmlDeviceGetPowerUsage(self.handle) / 1000  # NVML reports milliwatts

    def power_limit_w(self) -> float:
        return self.nv.nvmlDeviceGetEnforcedPowerLimit(self.handle) / 1000

    def sm_clock_mhz(self) -> int:
        return self.nv.nvmlDeviceGetClockInfo(self.handle, self.nv.NVML_CLOCK_SM)

    def pcie_byte_counts(self) -> tuple[int, int] | None:
        """The cumulative PCIe bytes sent and received, or None when NVML gave no count this time."""
        nv = self.nv
        values = nv.nvmlDeviceGetFieldValues(self.handle, [FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES])
        if any(v.nvmlReturn != nv.NVML_SUCCESS for v in values):
            return None
        return values[0].value.ullVal, values[1].value.ullVal

    def pcie_throughput_mb_s(self) -> tuple[float, float]:
        """PCIe MB/s sent and received, measured by NVML while the call blocks (~20 ms each)."""
        nv = self.nv
        tx = nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_TX_BYTES)
        rx = nv.nvmlDeviceGetPcieThroughput(self.handle, nv.NVML_PCIE_UTIL_RX_BYTES)
        return tx * 1e3 / 1e6, rx * 1e3 / 1e6  # NVML reports KB/s

    def process_samples(self, since_us: int) -> list:
        """NVML's per-process samples newer than `since_us` (its timestamps, in microseconds), each
        with .pid, .smUtil and .timeStamp. NOT_FOUND when there is none."""
        return self.nv.nvmlDeviceGetProcessUtilization(self.handle, since_us)


class NvmlMigInstance:
    """One MIG instance of a GPU in MIG mode, read through its GPU's queries: its failures are its
    GPU's problems. Static facts only: NVML gives utilization per GPU, not per instance."""

    def __init__(self, gpu_queries: Queries, handle):
        self.queries, self.handle = gpu_queries, handle
        self.nv = gpu_queries.nv

    @cached_property
    def uuid(self) -> str | None:
        """'MIG-aaaaaaaa-…', as CUDA_VISIBLE_DEVICES names it."""
        return self.queries.query("MIG instance uuid", lambda: as_str(self.nv.nvmlDeviceGetUUID(self.handle)))

    @cached_property
    def name(self) -> str | None:
        return self.queries.query("MIG instance name", lambda: as_str(self.nv.nvmlDeviceGetName(self.handle)))

    @cached_property
    def memory_total_mib(self) -> float | None:
        return self.queries.query(
            "MIG instance memory", lambda: self.nv.nvmlDeviceGetMemoryInfo(self.handle).total / 2**20
        )


class GpmPair:
    """Two GPM sample buffers of one GPU, filled in turn: each new sample and the one before it
    span the interval GPM's metrics are computed over (Hopper and newer)."""

    def __init__(self, nv, handle):
        self.nv, self.handle = nv, handle
        self._previous, self._current = nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()
        self._have_previous = False

    def metrics_since_last(self, metric_ids: Sequence[int]) -> dict[int, float | None]:
        """Take a sample; each metric (NVML_GPM_METRIC_* id) over the interval since the last
        sample, None where NVML could not compute it. {} for the first sample: it only opens a pair.
        Raises NVML's errors."""
        nv = self.nv
        previous, current = self._previous, self._current
        nv.nvmlGpmSampleGet(self.handle, current)
        self._previous, self._current = current, previous  # this sample is the next one's "previous"
        had_previous, self._have_previous = self._have_previous, True
        if not had_previous:
            return {}
        request = nv.c_nvmlGpmMetricsGet_t()
        request.version = nv.NVML_GPM_METRICS_GET_VERSION
        request.numMetrics = len(metric_ids)
        request.sample1 = previous
        request.sample2 = current
        for i, metric_id in enumerate(metric_ids):
            request.metrics[i].metricId = metric_id
        nv.nvmlGpmMetricsGet(request)
        found = (request.metrics[i] for i in range(len(metric_ids)))
        return {
            metric_id: float(m.value) if m.nvmlReturn == nv.NVML_SUCCESS else None
            for metric_id, m in zip(metric_ids, found)
        }

    def close(self) -> None:
        for sample in (self._previous, self._current):
            try:
                self.nv.nvmlGpmSampleFree(sample)
            except Exception:
                pass  # closing is best effort: nothing to do when a free fails
