"""Facts and settings of the host (CPU) side of a training process: the cores it may use, how
long its threads waited for one, and its memory allocator, glibc malloc with fixed thresholds.

glibc serves a large allocation (by default >= 128 KiB) with a fresh mmap and returns it to the
kernel when freed, so the next step's allocation of the same size page-faults and zeroes its
pages all over again. glibc raises that threshold on its own only after a large mmapped block
has been freed, so whether a CPU training step pays this cost depends on what the process
happened to allocate and free before. Seen here while building `gpulab plan`: two in-step
copies of LeNet's step (1 thread each) took 31-32 ms after loading a 43,520-image copy of
Fashion-MNIST and 24-26 ms after loading the whole set, and 24-25 ms with either once
MALLOC_MMAP_THRESHOLD_ was fixed; the committed side-by-side benchmark on a 10,240-image copy
(benchmarks/host_allocator.py) shows a smaller effect, 1.08x [0.95 .. 1.14] over 3 rounds.
Fixing the thresholds gives every process the fast case: blocks up to MMAP_THRESHOLD come from
the heap, and the heap is not trimmed below TRIM_THRESHOLD, so freed activations are reused
step after step (what PyTorch's CPU performance guide gets from jemalloc or tcmalloc). GPU
memory is not affected (the CUDA caching allocator keeps its blocks).

Set GPULAB_MALLOC=default to leave glibc's behaviour alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 * 2**20
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # glibc's own rule when it raises the threshold itself


def fix_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds for this process; False where there is no glibc
    (macOS, musl) or GPULAB_MALLOC=default asks to leave them."""
    if os.environ.get("GPULAB_MALLOC") == "default":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


PR_SET_PDEATHSIG = 1  # prctl: the signal this process gets when its parent dies
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants become this process's children


def prctl(option: int, value: int) -> bool:
    """Linux's prctl(option, value); False where it is not Linux or the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


# ----------------------------------------------------------------------------- cores


def seconds_since_start() -> float:
    """Wall seconds since this process was created: what a user who started the command has
    waited so far, interpreter start-up and imports included. On Linux both ends are counted from
    boot (/proc/uptime, and the process's start in /proc/self/stat: 10 ms ticks); psutil's
    create_time adds the boot time, which /proc/stat keeps to whole seconds - up to 1 s off."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        # the fields after the command's name (in parentheses, which may hold spaces): starttime is the 20th
        after_name = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time() - psutil.Process().create_time()


def usable_cores(pid: int = 0) -> int:
    """The cores process `pid` (0: this one) may run on: its affinity mask (taskset, a container's
    cpuset), and no more than its cgroup's CPU quota (docker --cpus, a Kubernetes CPU limit),
    rounded up as the JVM does (a 1.5-core quota: 2 threads each get 75% of a core)."""
    cores = len(usable_cpus(pid))
    quota = cgroup_cpu_quota(pid)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def usable_cpus(pid: int = 0) -> list[int]:
    """The CPUs process `pid` (0: this one) may run on: its affinity mask, where there is one."""
    return sorted(os.sched_getaffinity(pid)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(pid: int = 0) -> float | None:
    """The CPU quota, in cores, of the process's cgroups (cgroup_quota); None without one."""
    try:
        lines = Path(f"/proc/{pid or 'self'}/cgroup").read_text().splitlines()
    except OSError:
        return None
    return cgroup_quota(lines, CGROUP_ROOT)


def cgroup_quota(lines: list[str], root: Path) -> float | None:
    """The smallest CPU quota, in cores, of the cgroups /proc/<pid>/cgroup's `lines` name and of
    every cgroup above them (each limits the process): cgroup v2 (cpu.max) and v1
    (cpu.cfs_quota_us / cpu.cfs_period_us) under `root`. A path that does not exist here (a
    container sees its own cgroup as the root) is skipped."""
    quotas = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            files = [(root / d / "cpu.max", None) for d in _ancestors(path)]
        elif "cpu" in controllers.split(","):
            mount = root / controllers
            files = [(mount / d / "cpu.cfs_quota_us", mount / d / "cpu.cfs_period_us") for d in _ancestors(path)]
        else:
            continue
        quotas += [q for q in map(_read_quota, files) if q]
    return min(quotas, default=None)


def _ancestors(path: str) -> list[str]:
    """'/a/b' -> ['a/b', 'a', '']: the cgroup and every one above it, relative to the mount."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _read_quota(files: tuple[Path, Path | None]) -> float | None:
    quota_file, period_file = files
    try:
        if period_file is None:  # v2: "max 100000" or "150000 100000"
            quota, period = quota_file.read_text().split()
        else:  # v1: -1 when there is none
            quota, period = quota_file.read_text().strip(), period_file.read_text().strip()
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


# ----------------------------------------------------------------------------- waiting for a core

# Busy threads that waited for a core at least this share of the time they had work, with more of
# them than cores, are contended: gpulab train warns, gpulab profile names `cpu_contention`.
# Measured on this project's 2-core VM: compute-bound steps at torch's 2 threads waited 1-4% alone
# and 37-38% with one busy process beside them (docs/profiling.md).
CONTENDED_WAIT_SHARE = 0.15
# More busy threads than cores: the job's busy threads and the cores other processes used exceed
# the usable cores by at least this much.
OVERSUBSCRIBED_BY = 0.25
# A core counts as free for one more thread when at most this much of it is in use.
CORE_SLACK = 0.25


@dataclass
class ThreadTimes:
    """Threads' time on a core (`ran`) and waiting on a run queue for one (`waited`), in ns, summed
    over every thread and over the busy ones: those that had work (ran or waited) at least half of
    the interval they were measured over. A busy thread's wait is a share of the step it stood
    still (torch's compute threads, a busy DataLoader worker); a mostly idle thread's is not (a
    thread waking from a sleep behind torch's spinning OpenMP thread "waited" ~40% of its little
    work on this VM, with the cores 70% idle)."""

    ran: int = 0
    waited: int = 0
    busy_ran: int = 0
    busy_waited: int = 0

    def add(self, ran: int, waited: int, interval: float | None) -> bool:
        """One thread's time over `interval` ns (None: not known, as for a thread first seen, which
        counts from its start; not busy); whether it was busy."""
        self.ran, self.waited = self.ran + ran, self.waited + waited
        busy = interval is not None and ran + waited >= interval / 2
        if busy:
            self.busy_ran, self.busy_waited = self.busy_ran + ran, self.busy_waited + waited
        return busy


@dataclass(frozen=True)
class CoreWait:
    """What a job's threads did over `seconds` of wall time on `cores` usable cores (ThreadTimes,
    in seconds; `busy_threads`: how many were busy), and the core time other processes used on
    those cores."""

    seconds: float
    cores: int
    busy_threads: float
    ran_s: float
    waited_s: float
    busy_ran_s: float
    busy_waited_s: float
    others_s: float

    @property
    def demand(self) -> float:
        """The threads that had work (ran or waited to run), on average."""
        return (self.ran_s + self.waited_s) / self.seconds

    @property
    def others_cores(self) -> float:
        return self.others_s / self.seconds

    @property
    def share(self) -> float:
        """The share of the time the busy threads had work that they waited for a core: for a
        thread that always has work, the share of the step it stood still."""
        worked = self.busy_ran_s + self.busy_waited_s
        return self.busy_waited_s / worked if worked > 0 else 0.0

    @property
    def oversubscribed(self) -> bool:
        """More busy threads than cores, counting the cores other processes used. Not so for a
        2-rank gloo DDP job on 2 cores, whose 2 busy training threads waited 27% of the time
        for the ranks' intermittent communication threads: fewer threads would not help."""
        return self.busy_threads + self.others_cores >= self.cores + OVERSUBSCRIBED_BY

    @property
    def contended(self) -> bool:
        """A large share waited, with more busy threads than cores."""
        return self.share >= CONTENDED_WAIT_SHARE and self.oversubscribed

    def threads_to_try(self, torch_threads: int, workers: int = 0) -> int:
        """torch threads that leave every busy thread a core: the whole cores other processes leave
        free, less the DataLoader workers - and fewer than now (gpulab profile's fix, gpulab
        train's warning)."""
        free = max(1, int(self.cores - self.others_cores + CORE_SLACK))
        return max(1, min(free - workers, torch_threads - 1))


def schedstat(pid: int, tid: int) -> tuple[int, int] | None:
    """(ns thread `tid` of process `pid` ran on a core, ns it waited on a run queue for one), from
    /proc/<pid>/task/<tid>/schedstat; None when it is gone or the kernel does not say."""
    try:
        with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
            ran, waited, _ = f.read().split()
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def thread_ids(pid: int) -> list[int]:
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_SETTLE_POLL_S = 0.002  # long enough for a worker waiting for the GIL to finish its decrefs
_SETTLE_QUIET = 3  # checks in a row with no worker runnable
_SETTLE_MAX_S = 1.0


def thread_states(pid: int, name: str) -> list[str]:
    """The scheduler states (R running or runnable, S sleeping, ...) of the threads of process
    `pid` that bear that name ([] where /proc is not there)."""
    states = []
    for tid in thread_ids(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has just ended
            continue
        # "tid (name) S ...": a name may hold spaces or parentheses, so the state follows the last ")"
        end = stat.rfind(")")
        if stat[stat.find("(") + 1:end] == name:
            states.append(stat[end + 2:end + 3])
    return states


def let_gloo_workers_finish(max_s: float = _SETTLE_MAX_S) -> None:
    """Wait until no gloo worker thread of this process is runnable, the GIL free meanwhile: call
    it after the last collective, before destroying the group or leaving Python.

    A gloo worker lets go of a finished collective (and its tensors) a moment after the script has
    moved on, and each tensor hands its Python object back under the GIL. A group destroyed
    meanwhile joins that worker while holding the GIL: a deadlock. Python finalizing meanwhile
    takes the GIL away: the process aborts ("terminate called without an active exception"; a
    torch race: DDP keeps the group and its workers alive to the end, and plain torchrun runs of
    tests/monitor/scripts/ddp_faults.py hit it 1 time in 30 here). A runnable worker has not
    finished letting go; one waiting for the GIL gets it during the sleeps. None runnable at
    _SETTLE_QUIET checks in a row: done. Returns at once without gloo."""
    deadline = time.monotonic() + max_s
    quiet = 0
    while quiet < _SETTLE_QUIET and time.monotonic() < deadline:
        states = thread_states(os.getpid(), GLOO_WORKER)
        if not states:
            return
        quiet = 0 if "R" in states else quiet + 1
        time.sleep(_SETTLE_POLL_S)  # the GIL is free meanwhile


def cpus_busy_s(cpus: list[int]) -> float:
    """Seconds CPUs `cpus` were busy with anything since boot, summed: /proc/stat's user, nice,
    system, irq and softirq time (not idle, iowait or steal); 0 without /proc (not Linux)."""
    wanted = {f"cpu{i}" for i in cpus}
    ticks = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *fields = line.split()
                if name in wanted:
                    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields[:7])
                    ticks += user + nice + system + irq + softirq
    except OSError:
        return 0.0
    return ticks / os.sysconf("SC_CLK_TCK")


class CoreWatch:
    """This process's threads between start() and stop(): gpulab train's epoch. A thread that
    started in between counts from its start; one that ended in between is lost."""

    def start(self) -> "CoreWatch":
        self._pid = os.getpid()
        self._cpus = usable_cpus()
        self._t0, self._threads0, self._busy0 = time.perf_counter(), self._threads(), cpus_busy_s(self._cpus)
        return self

    def stop(self) -> CoreWait | None:
        """None where the kernel keeps no schedstat (not Linux)."""
        seconds = time.perf_counter() - self._t0
        busy, after = cpus_busy_s(self._cpus) - self._busy0, self._threads()
        if not after or seconds <= 0:
            return None
        times, busy_threads = ThreadTimes(), 0
        for tid, (ran, waited) in after.items():
            ran0, waited0 = self._threads0.get(tid, (0, 0))
            busy_threads += times.add(ran - ran0, waited - waited0, seconds * 1e9)
        return CoreWait(seconds, usable_cores(), busy_threads, times.ran / 1e9, times.waited / 1e9,
                        times.busy_ran / 1e9, times.busy_waited / 1e9, max(0.0, busy - times.ran / 1e9))

    def _threads(self) -> dict[int, tuple[int, int]]:
        found = {tid: schedstat(self._pid, tid) for tid in thread_ids(self._pid)}
        return {tid: times for tid, times in found.items() if times is not None}
