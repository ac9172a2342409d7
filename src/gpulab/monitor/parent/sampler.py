"""A background thread that samples the GPUs (NVML) and the training process (psutil).

What each GPU number means, honestly:
- `kernel_active_pct` is NVML's "utilization.gpu": the share of the sample period in which *at
  least one* kernel was running. One tiny kernel at a time on one SM reads 100 %. It says the GPU
  was not idle, not that it was busy.
- `memory_busy_pct` ("utilization.memory"): the share of the period device memory was read or written.
- On Hopper and newer, NVML's GPM counters say how much of the chip worked: `sm_active_pct` (share
  of SMs busy), `sm_occupancy_pct` (resident warps vs the maximum), `tensor_active_pct` (tensor
  pipes) and `dram_bw_pct` (share of peak memory bandwidth).

NVML is read through `gpulab.hardware.nvml_gpus` (as `gpulab devices` reads it) and its one error
policy: a metric the driver or GPU refuses is dropped after its first refusal; any other failure
reads None for that sample. Without NVML or a GPU, the process and the cores are still sampled.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import suppress

import psutil

from gpulab.hardware.nvml import Queries, start_nvml, stop_nvml
from gpulab.hardware.nvml_gpus import NvmlGpu, list_gpus
from gpulab.hardware.visible import cuda_visible_devices, parse_cuda_visible_devices
from gpulab.host import ThreadTimes, cpus_busy_s, schedstat, thread_ids, usable_cores, usable_cpus

# GPM metric ids (nvml.h: NVML_GPM_METRIC_*), with the names gpulab reports them under.
GPM_METRICS = {
    2: "sm_active_pct",  # SM_UTIL
    3: "sm_occupancy_pct",  # SM_OCCUPANCY
    5: "tensor_active_pct",  # ANY_TENSOR_UTIL
    10: "dram_bw_pct",  # DRAM_BW_UTIL
}

# Reading /proc costs ~0.1-0.3 ms of CPU per file: only the main process's CPU time and memory
# are read every sample; its thread count and the DataLoader workers (the list of children needs
# a scan of /proc) are refreshed this often, their values repeated in between.
_SLOW_REFRESH_S = 1.0
_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess)


# ----------------------------------------------------------------------------- GPUs


# NVML's GPM documentation asks for samples more than 100 ms apart; the sampler's own interval may
# be shorter (--interval), so a GPM pair spans at least this long, whatever the interval.
GPM_MIN_GAP_S = 0.15
# One GPM read where every metric fails can be a transient (a busy driver, a clock change): give
# up on GPM only after this many in a row.
GPM_FAILURES_BEFORE_OFF = 3


class GpuReader:
    """Per-GPU samples of the GPUs this process may use; `status` says why there are none."""

    def __init__(self, job_pids=None):
        # job_pids: the pids whose GPU use is "the job's", for NVML's per-process utilization
        # (device-wide figures also count other users of a shared GPU); None: not asked
        self._job_pids = job_pids
        self.status = "ok"
        self.gpus: list[dict] = []  # static facts: index, name, uuid, memory_total_mib, gpm
        self._sampled: list[_SampledGpu] = []
        self._nvml, _, why = start_nvml()
        if self._nvml is None:
            self.status = why
            return
        listing = Queries(self._nvml)
        found = list_gpus(listing)
        self._sampled = [_SampledGpu(gpu, self._nvml) for gpu in _visible(found) if gpu.handle is not None]
        self.gpus = [s.info for s in self._sampled]
        # What failed while listing and opening, each GPU's static facts included, is one status.
        problem = next((q.problem for q in [listing, *(gpu.queries for gpu in found)] if q.problem), None)
        if problem:
            self.status = f"NVML error while listing GPUs ({problem})"
        elif not self.gpus:
            self.status = "no GPU visible"

    def read(self) -> list[dict]:
        return [s.read(self._job_pids) for s in self._sampled] if self._nvml is not None else []

    def unsupported(self) -> dict[int, list[str]]:
        """What NVML refused for good, per GPU index."""
        return {s.gpu.index: sorted(s.queries.unsupported) for s in sorted(self._sampled, key=lambda s: s.gpu.index)
                if s.queries.unsupported}

    def close(self) -> None:
        if self._nvml is None:
            return
        for s in self._sampled:
            if s.gpm is not None:
                s.gpm.close()
                s.gpm = None
        stop_nvml(self._nvml)
        self._nvml = None


class _SampledGpu:
    """One GPU's readings, and what is kept between them: the counters' last values, and which
    metrics NVML refused."""

    def __init__(self, gpu: NvmlGpu, nv):
        self.gpu = gpu
        self.info = {"index": gpu.index, "name": gpu.name, "uuid": gpu.uuid, "memory_total_mib": gpu.memory_total_mib,
                     "gpm": False}
        self.pcie_counters = gpu.has_pcie_counters  # read once, at the start, as the facts are
        self.gpm = gpu.open_gpm()  # older drivers and GPUs have no GPM
        self.info["gpm"] = self.gpm is not None
        self.queries = Queries(nv)  # the samples' queries: what NVML refused
        self.pcie_last: tuple[float, int, int] | None = None
        self.process_ts = 0  # NVML's timestamp (us) of the last per-process sample seen
        self.gpm_taken_at = -GPM_MIN_GAP_S
        self.gpm_failures = 0

    def read(self, job_pids) -> dict:
        gpu, row = self.gpu, {}

        def util():
            kernel_active, memory_busy = gpu.utilization_pct()
            return {"kernel_active_pct": float(kernel_active), "memory_busy_pct": float(memory_busy)}

        self._try("utilization", row, util)
        self._try("memory_used_mib", row, gpu.memory_used_mib)
        self._try("power_w", row, gpu.power_w)
        self._try("sm_clock_mhz", row, lambda: float(gpu.sm_clock_mhz()))
        self._try("pcie", row, self._pcie)
        if job_pids is not None:  # NOT_FOUND: no process used the GPU since the last sample seen
            self._try("process_utilization", row, lambda: self._process_sm(job_pids()),
                      none_found={"process_sm_pct": 0.0})
        if self.gpm is not None and self._gpm_due():
            self._try("gpm", row, self._gpm_metrics)
        return row

    def _try(self, metric: str, row: dict, read, none_found=None) -> None:
        """Store `read()` under `metric` (or merge a dict); None when this sample failed, and
        nothing at all once NVML has refused the metric for good."""
        value = self.queries.query(metric, read, none_found)
        if metric in self.queries.unsupported:
            return
        if isinstance(value, dict):
            row.update(value)
        else:
            row[metric] = value

    def _pcie(self) -> dict:
        """PCIe MB/s from NVML's cumulative byte counters (non-blocking), else the 20 ms sampled API."""
        if not self.pcie_counters:
            tx_mb_s, rx_mb_s = self.gpu.pcie_throughput_mb_s()  # blocks ~20 ms per call: only as a fallback
            return {"pcie_tx_mb_s": tx_mb_s, "pcie_rx_mb_s": rx_mb_s}
        counts = self.gpu.pcie_byte_counts()
        if counts is None:
            return {}  # no counts this time: the next rate spans the gap
        now, (tx, rx) = time.perf_counter(), counts
        last, self.pcie_last = self.pcie_last, (now, tx, rx)
        if last is None or now <= last[0]:
            return {}
        dt = now - last[0]
        return {"pcie_tx_mb_s": (tx - last[1]) / dt / 1e6, "pcie_rx_mb_s": (rx - last[2]) / dt / 1e6}

    def _process_sm(self, pids: set[int]) -> dict:
        """The job's own SM share on this GPU: NVML's per-process samples since the last read,
        averaged per process and summed over the job's processes."""
        found = self.gpu.process_samples(self.process_ts)
        if found:
            self.process_ts = max(s.timeStamp for s in found)
        per_pid: dict[int, list[float]] = {}
        for s in found:
            if s.pid in pids:
                per_pid.setdefault(s.pid, []).append(float(s.smUtil))
        return {"process_sm_pct": sum(sum(v) / len(v) for v in per_pid.values())}

    def _gpm_due(self) -> bool:
        now = time.monotonic()
        if now - self.gpm_taken_at < GPM_MIN_GAP_S:
            return False
        self.gpm_taken_at = now
        return True

    def _gpm_metrics(self) -> dict:
        """GPM metrics over the interval between the previous sample and this one."""
        by_id = self.gpm.metrics_since_last(list(GPM_METRICS))
        if not by_id:
            return {}  # the first sample only opens a pair
        out = {name: by_id[metric_id] for metric_id, name in GPM_METRICS.items()}
        if all(v is None for v in out.values()):
            self.gpm_failures += 1
            if self.gpm_failures >= GPM_FAILURES_BEFORE_OFF:
                self.queries.unsupported.add("gpm")  # never asked again, like a refused metric
                return {}
            return out
        self.gpm_failures = 0
        return out


def _visible(gpus: list[NvmlGpu]) -> list[NvmlGpu]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES selects them. A MIG instance selects
    its GPU: NVML gives utilization per GPU, not per MIG instance."""
    instances = [gpu.mig_instances or [] for gpu in gpus]
    uuids = [gpu.uuid for gpu in gpus]
    mig_uuids = [[m.uuid for m in found] for found in instances]
    selected = parse_cuda_visible_devices(cuda_visible_devices(), uuids, mig_uuids)
    chosen = dict.fromkeys(s.nvml_index for s in selected)  # two instances of one GPU: sampled once
    return [gpus[i] for i in chosen]


# ----------------------------------------------------------------------------- the process


class ProcessReader:
    """CPU %, memory and threads of one process, and the sum over its children (DataLoader workers,
    multiprocessing children).

    CPU % is psutil's: 100 means one core busy. The children's CPU is counted from CPU *time*: the
    live ones' own, plus what the kernel credits a parent for the children it has reaped, so that
    workers that live for one epoch only, even for less than a sampling period, still count.
    """

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.proc.cpu_percent(None)  # the first call only starts psutil's measurement
        self.children: dict[int, psutil.Process] = {}
        self._slow = {"threads": self.proc.num_threads(), "workers": 0, "workers_cpu_pct": 0.0, "workers_rss_mib": 0.0}
        self._slow_read_at = time.monotonic()
        self._children_cpu_s = self._reaped_cpu_s()

    def read(self) -> dict | None:
        try:
            with self.proc.oneshot():
                row = {"cpu_pct": self.proc.cpu_percent(None), "rss_mib": self.proc.memory_info().rss / 2**20}
        except _GONE:
            return None
        now = time.monotonic()
        if now - self._slow_read_at >= _SLOW_REFRESH_S:
            self._read_slow(now - self._slow_read_at)
            self._slow_read_at = now
        row.update(self._slow)
        return row

    def _reaped_cpu_s(self) -> float:
        times = self.proc.cpu_times()
        return times.children_user + times.children_system

    def _read_slow(self, elapsed_s: float) -> None:
        """Threads, and the children's CPU % (averaged since the last slow read) and memory."""
        try:
            self._slow["threads"] = self.proc.num_threads()
            found = {c.pid: c for c in self.proc.children(recursive=True)}
            cpu_s = self._reaped_cpu_s()
        except _GONE:
            return
        rss = 0.0
        for pid, child in list(found.items()):
            known = self.children.setdefault(pid, child)
            try:
                with known.oneshot():
                    t = known.cpu_times()
                    cpu_s += t.user + t.system + t.children_user + t.children_system
                    rss += known.memory_info().rss / 2**20
            except _GONE:
                found.pop(pid, None)
        self.children = {pid: self.children[pid] for pid in found}
        # A child that died since the last read and is not reaped yet drops out for a moment:
        # never report a negative rate for that.
        used = max(0.0, cpu_s - self._children_cpu_s)
        self._children_cpu_s = max(cpu_s, self._children_cpu_s)
        self._slow.update(workers=len(found), workers_cpu_pct=100 * used / elapsed_s, workers_rss_mib=rss)


# ----------------------------------------------------------------------------- the cores


PRESSURE_FILE = "/proc/pressure/cpu"


class CoreReader:
    """How the job's threads got the cores, as running totals (seconds since the sampler started),
    so that the analysis takes the difference between any two samples (analyze/contention.py):

    - `ran_s`, `waited_s`: every thread of the job's processes on a core, and runnable but waiting
      for one (/proc/<pid>/task/<tid>/schedstat). A thread first seen counts from its start (a
      worker is known within _SLOW_REFRESH_S: it loses nothing); one that ended since the last
      sample loses that sample's share.
    - `busy_ran_s`, `busy_waited_s`: the same for the threads that had work at least half of each
      interval (gpulab.host.ThreadTimes); `busy_threads`: how many did, in the last interval.
    - `cores`: the cores the job may use (affinity, cgroup quota); `cores_busy_s`: the time those
      CPUs were busy with anything (/proc/stat).
    - `pressure_s`: the kernel's CPU pressure "some" (/proc/pressure/cpu); None without PSI.

    Each sample reads every thread's counters (~10 us a thread); the job's cores every _SLOW_REFRESH_S.
    """

    def __init__(self, pid: int, job_pids):
        self.pid = pid
        self._job_pids = job_pids
        self._last: dict[tuple[int, int], tuple[int, int]] = {}  # (pid, tid) -> (ran ns, waited ns)
        self._cores, self._cpus = usable_cores(pid), usable_cpus(pid)
        self._cores_read_at = time.monotonic()
        self._last_t = time.perf_counter()
        self._busy0, self._pressure0 = cpus_busy_s(self._cpus), self._pressure_s()
        self._times = ThreadTimes()

    def read(self) -> dict:
        now = time.monotonic()
        if now - self._cores_read_at >= _SLOW_REFRESH_S:
            with suppress(OSError):  # the job's first process has ended: keep what was known
                self._cores, self._cpus = usable_cores(self.pid), usable_cpus(self.pid)
            self._cores_read_at = now
        t = time.perf_counter()
        interval_ns = (t - self._last_t) * 1e9
        self._last_t = t
        busy_threads, seen = 0, {}
        for pid in self._job_pids():
            for tid in thread_ids(pid):
                times = schedstat(pid, tid)
                if times is None:  # it ended meanwhile
                    continue
                if (pid, tid) in self._last:
                    ran0, waited0 = self._last[pid, tid]
                    busy_threads += self._times.add(times[0] - ran0, times[1] - waited0, interval_ns)
                else:
                    self._times.add(*times, interval=None)
                seen[pid, tid] = times
        self._last = seen
        pressure = self._pressure_s()
        return {
            "ran_s": self._times.ran / 1e9,
            "waited_s": self._times.waited / 1e9,
            "busy_ran_s": self._times.busy_ran / 1e9,
            "busy_waited_s": self._times.busy_waited / 1e9,
            "busy_threads": busy_threads,
            "cores": self._cores,
            "cores_busy_s": cpus_busy_s(self._cpus) - self._busy0,
            "pressure_s": pressure - self._pressure0 if pressure is not None else None,
        }

    @staticmethod
    def _pressure_s() -> float | None:
        try:
            with open(PRESSURE_FILE) as f:
                some = f.readline().split()
            return int(some[-1].removeprefix("total=")) / 1e6
        except (OSError, ValueError, IndexError):
            return None


# ----------------------------------------------------------------------------- the sampler


MAX_SAMPLES = 20_000  # ~35 minutes at 0.1 s; beyond it, every other one is dropped and the interval doubled


class Sampler:
    """Samples the GPUs and process `pid` every `interval_s` seconds on a daemon thread.

    `samples`: {"t": perf_counter seconds, "gpus": [per-GPU dict], "proc": {...} or None, "cores":
    CoreReader's totals or None}; perf_counter is CLOCK_MONOTONIC on Linux, the same clock in every
    process, so samples line up with the steps recorded in the job. `cost_s`: each sample's CPU time.
    """

    def __init__(self, interval_s: float = 0.1, pid: int | None = None):
        if not interval_s > 0:
            raise ValueError(f"sampling interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.pid = pid if pid is not None else os.getpid()
        self.gpu = GpuReader(job_pids=self._job_pids)
        self.samples: list[dict] = []
        self.cost_s: list[float] = []
        self._proc: ProcessReader | None = None
        self._cores: CoreReader | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _job_pids(self) -> set[int]:
        """The sampled process and its children (DataLoader workers, ranks under torchrun)."""
        proc = self._proc
        return {self.pid, *proc.children} if proc else {self.pid}

    def start(self) -> "Sampler":
        try:
            self._proc = ProcessReader(self.pid)
            self._cores = CoreReader(self.pid, self._job_pids) if sys.platform.startswith("linux") else None  # /proc
        except (psutil.Error, OSError):
            self._proc = self._cores = None
        self._thread = threading.Thread(target=self._run, name="gpulab-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        self.gpu.close()

    def sample(self) -> dict:
        # The cost is this thread's CPU time, not wall time: waiting for the GIL while the training
        # thread runs Python is not work the sampler takes away from it.
        cpu0 = time.thread_time()
        row = {"t": time.perf_counter(), "gpus": self.gpu.read(), "proc": self._proc.read() if self._proc else None,
               "cores": self._cores.read() if self._cores else None}
        self.cost_s.append(time.thread_time() - cpu0)
        return row

    def _run(self) -> None:
        next_t = time.perf_counter()
        while True:
            self.samples.append(self.sample())
            if len(self.samples) >= MAX_SAMPLES:  # bounded, whatever the run's length
                self.samples, self.cost_s = self.samples[::2], self.cost_s[::2]
                self.interval_s *= 2
            next_t += self.interval_s
            now = time.perf_counter()
            if next_t < now:  # a sample took longer than the interval: skip, don't bunch up
                next_t = now + self.interval_s
            if self._stop.wait(next_t - now):
                return

    def summary(self) -> dict:
        """Facts about the sampler itself for the report: interval, count, its own cost."""
        mean = sum(self.cost_s) / len(self.cost_s) if self.cost_s else 0.0
        return {
            "interval_s": self.interval_s,
            "samples": len(self.samples),
            "mean_cpu_cost_ms": mean * 1e3,
            "busy_share": mean / self.interval_s,  # the fraction of one core the sampler keeps busy
            "nvml": self.gpu.status,
            "unsupported_metrics": {str(k): v for k, v in self.gpu.unsupported().items()},
        }
