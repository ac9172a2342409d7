#!/usr/bin/env python3
"""Run every check of gpulab's GPU paths, compare each with its expected result, write one JSON.

    python3 scripts/gpu_check.py [--out DIR] [--only NAME ...] [--budget-s 290] [--repeat N [--jobs 4]] [--compile]

From the repository root of a checkout (gpulab need not be installed: src/ is put on the path).
Each check says what it needs (a GPU, two GPUs, Hopper), what it expects and what it saw; checks
whose hardware is missing are "skipped", never passed. The GPU tests run under pytest and each
test is a row of its own. The most important checks run first (the profiler's GPU tests, then
training and parity), and DIR/gpu_check.json (default DIR: gpu-check/) is rewritten after every
check and every test, so a run cut from outside leaves every finished result; checks not started
within --budget-s are "not run (budget)". --repeat N adds profile-no-crash: each planted CUDA
script N times under `gpulab profile`, counting exits other than the script's own; --compile adds
compiled training (issue 35: parity, the training benchmark, profiled runs). Exit code 0 when
nothing failed. The list, in order, with each expected result, is docs/gpu-checklist.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "monitor" / "scripts"
PROFILER_TESTS = ["tests/monitor/test_gpu.py", "tests/monitor/test_kernel_window.py"]
OTHER_GPU_TESTS = ["tests/test_devices.py", "tests/hardware/test_describe.py", "tests/bench/test_bench_cli.py",
                   "tests/bench/test_by_hand.py"]
# The planted CUDA scripts (tests/monitor/scripts/), each exits 0 on its own.
PLANTED_CUDA_SCRIPTS = ("item_every_step.py", "annotated_step.py", "slow_loader_gpu.py", "tiny_kernels.py",
                        "pageable_copy.py", "pinned_blocking_copy.py", "masked_index.py",
                        "whole_step_graph.py", "gc_pressure.py 120 cuda")  # a script and its arguments
EVENTS_ENV = "GPU_CHECK_EVENTS"  # where the pytest plugin at the end of this file writes its events


@dataclass
class Check:
    name: str
    needs: str  # "nothing" | "gpu" | "2 gpus" | "hopper"
    expected: str
    run: Callable[["Check", Path], str] | None  # returns what was seen; raises Failed when it is not the expected
    status: str = "not run"  # then "running", and one of: pass, fail, error, skipped, not run (budget)
    seen: str = ""
    seconds: float = 0.0
    log: str | None = None
    details: dict = field(default_factory=dict)  # anything a check records beyond `seen` (exit codes, ...)
    part_of: str | None = None  # a test's row: the pytest check it ran in
    tests: list["Check"] = field(default_factory=list)  # a pytest check's tests, one row each
    # The runner's: a pytest check hands it each test's row as the test ends (printed, and saved at once).
    row_done: Callable[["Check"], None] = field(default=lambda row: None, repr=False)

    def as_json(self) -> dict:
        row = {k: v for k, v in asdict(self).items() if k not in ("run", "tests", "row_done")}
        return {k: v for k, v in row.items() if v or k in ("status", "seen", "seconds")}


class Failed(Exception):
    """The check ran and saw something other than what it expects."""


class BudgetSpent(Exception):
    """The run's --budget-s ran out while this check was running: it was stopped."""


class Terminated(BaseException):
    """gpu_check itself got SIGTERM (a lease's timeout): not a check's error, so not an Exception."""


@dataclass
class Machine:
    gpus: int = 0
    capability: tuple[int, int] | None = None
    name: str = ""
    facts: dict = field(default_factory=dict)

    @classmethod
    def probe(cls) -> "Machine":
        import torch

        m = cls(facts={"torch": torch.__version__, "torch_cuda_build": torch.version.cuda, "python": sys.version.split()[0]})
        if torch.cuda.is_available():
            m.gpus = torch.cuda.device_count()
            m.capability = torch.cuda.get_device_capability(0)
            m.name = torch.cuda.get_device_name(0)
            m.facts.update(gpus=m.gpus, gpu=m.name, capability=f"{m.capability[0]}.{m.capability[1]}")
        return m

    def has(self, needs: str) -> bool:
        return {"nothing": True, "gpu": self.gpus >= 1, "2 gpus": self.gpus >= 2,
                "hopper": self.gpus >= 1 and self.capability is not None and self.capability[0] >= 9}[needs]


class Budget:
    """The seconds this run may still use; every command's timeout is cut to what is left."""

    def __init__(self):
        self.deadline = math.inf

    def start(self, seconds: float, at: float | None = None) -> None:
        self.deadline = (time.monotonic() if at is None else at) + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


BUDGET = Budget()


# ----------------------------------------------------------------------------- running things

_LIVE: set[subprocess.Popen] = set()  # commands running now (several at once under --jobs)
_LIVE_LOCK = threading.Lock()


def gpulab(args: list[str], log: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "gpulab", *args], log, timeout, **env)


def run(cmd: list[str], log: Path, timeout: float = 300, **env_overrides: str) -> subprocess.CompletedProcess:
    """`cmd` from the repository root with src/ on the path, its output written to `log`. A command
    that outlives `timeout`, or the run's budget, is stopped with its whole process group."""
    # Output goes to files, not pipes: a grandchild that outlives a stopped command cannot hang us.
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = start(cmd, stdout, stderr, **env_overrides)
        stopped = False
        try:
            proc.wait(timeout=max(0.0, min(timeout, BUDGET.left())))
        except subprocess.TimeoutExpired:
            stop_process_group(proc)
            stopped = True
        except BaseException:  # SIGTERM or Ctrl-C while we wait: the command goes too
            stop_process_group(proc, grace_s=2.0)
            raise
        finally:
            forget(proc)
        stdout.seek(0), stderr.seek(0)
        done = subprocess.CompletedProcess(cmd, proc.returncode, stdout.read(), stderr.read())
    log.write_text(f"$ {' '.join(cmd)}\nexit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    if stopped and BUDGET.left() <= 0:
        raise BudgetSpent(f"stopped when the budget ran out (see {log.name})")
    if stopped:
        raise Failed(f"did not end within {timeout:.0f} s: stopped (see {log.name})")
    return done


def start(cmd: list[str], stdout, stderr, extra_path: tuple[Path, ...] = (), **env_overrides: str) -> subprocess.Popen:
    """Start `cmd` in a process group of its own (to stop it whole), registered until forgotten."""
    path = [str(ROOT / "src"), *map(str, extra_path), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, **env_overrides, "PYTHONPATH": os.pathsep.join(p for p in path if p)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, text=True, start_new_session=True)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def forget(proc: subprocess.Popen) -> None:
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def stop_process_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """SIGTERM to the command's process group (gpulab profile then stops its job and writes what it
    has), SIGKILL to what is left after `grace_s`."""
    for signum, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        proc.wait()


def stop_live_processes() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        stop_process_group(proc, grace_s=2.0)


def exit_name(code: int | str | None) -> str:
    """An exit code as people read it: 139 (SIGSEGV) - a shell's 128 + signal, or Python's -signal."""
    if not isinstance(code, int):
        return str(code)
    signum = -code if code < 0 else code - 128 if code > 128 else None
    try:
        return f"{code} ({signal.Signals(signum).name})" if signum else str(code)
    except ValueError:
        return str(code)


def planted_site(script: str) -> str:
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if '# planted:' in line)}"


def profile_report(script: str, out: Path, log: Path, *args: str, exit_code: int = 0) -> dict:
    done = gpulab(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / script), *args], log)
    if done.returncode != exit_code:
        raise Failed(f"gpulab profile exited {exit_name(done.returncode)}, not {exit_code} (see {log.name})")
    return json.loads((out / "report.json").read_text())


def top_finding(report: dict) -> dict:
    return report["findings"][0] if report["findings"] else {"cause": "none", "where": None}


# ----------------------------------------------------------------------------- the checks


def check_devices(check: Check, out: Path) -> str:
    done = gpulab(["devices", "--json"], out / "devices.log")
    if done.returncode != 0:
        raise Failed(f"gpulab devices --json exited {done.returncode}")
    report = json.loads(done.stdout)
    (out / "devices.json").write_text(json.dumps(report, indent=2))
    verdict = report.get("verdict")
    if not verdict:
        raise Failed("no verdict in gpulab devices --json")
    seen = f"verdict {verdict.get('status')}: {verdict.get('message')}"
    gpus_torch_sees = report.get("torch_sees_gpus", 0)
    if gpus_torch_sees and verdict.get("status") not in ("ok", "warning"):
        raise Failed(seen)
    if not gpus_torch_sees and verdict.get("status") == "ok":
        raise Failed(f"{seen} although torch sees no GPU")
    return seen


def check_devices_hidden(check: Check, out: Path) -> str:
    done = gpulab(["devices", "--json"], out / "devices-hidden.log", CUDA_VISIBLE_DEVICES="")
    verdict = json.loads(done.stdout).get("verdict") or {}
    seen = f"verdict {verdict.get('status')}: {verdict.get('message')} / fix: {verdict.get('fix')}"
    if "CUDA_VISIBLE_DEVICES" not in f"{verdict.get('message')} {verdict.get('fix')}" or verdict.get("status") == "ok":
        raise Failed(seen)
    return seen


def check_train(check: Check, out: Path) -> str:
    run_dir = out / "train-lenet"
    done = gpulab(["train", "--devices", "cuda", "--epochs", "3", "--out", str(run_dir)], out / "train.log")
    if done.returncode != 0:
        raise Failed(f"gpulab train exited {done.returncode}")
    last = json.loads((run_dir / "metrics.json").read_text())[-1]
    seen = f"test acc {last['test_acc']:.3f} after 3 epochs, {last['samples_per_s']:,.0f} samples/s in the last"
    if last["test_acc"] < 0.80:
        raise Failed(seen)
    return seen


def parity(devices: str, log: Path, *args: str, **env: str) -> str:
    done = gpulab(["train", "--devices", devices, "--check-parity", *args], log, **env)
    lines = [line for line in done.stdout.splitlines() if "parity" in line or "difference" in line]
    seen = "; ".join(line.strip() for line in lines[-3:])
    if done.returncode != 0 or "parity PASS" not in done.stdout:
        raise Failed(seen or f"exit {done.returncode}")
    return seen


def check_parity_1(check: Check, out: Path) -> str:
    return parity("cuda", out / "parity-1gpu.log")


def check_parity_2(check: Check, out: Path) -> str:
    return parity("cuda:0,cuda:1", out / "parity-2gpu.log")


def check_launch_nccl(check: Check, out: Path) -> str:
    done = gpulab(["launch", "-n", "2", "--", "--check-parity"], out / "launch-nccl.log")
    if done.returncode != 0 or "parity PASS" not in done.stdout:
        raise Failed(f"exit {done.returncode}; see launch-nccl.log")
    return "2 ranks under torchrun, NCCL: parity PASS"


def check_fsdp_nccl(check: Check, out: Path) -> str:
    """--shard fsdp over NCCL: parity with plain PyTorch, then an epoch whose checkpoint is sharded."""
    done = gpulab(["launch", "-n", "2", "--", "--shard", "fsdp", "--check-parity"], out / "fsdp-parity.log")
    if done.returncode != 0 or "parity PASS" not in done.stdout:
        raise Failed(f"parity: exit {done.returncode}; see fsdp-parity.log")
    run = out / "fsdp-run"
    done = gpulab(["launch", "-n", "2", "--", "--shard", "fsdp", "--epochs", "1", "--out", str(run)], out / "fsdp-run.log")
    shards = sorted(p.name for p in run.glob("checkpoint-epoch*.dcp"))
    if done.returncode != 0 or shards != ["checkpoint-epoch1.dcp"]:
        raise Failed(f"epoch: exit {done.returncode}, shards {shards}; see fsdp-run.log")
    return "2 ranks, NCCL, --shard fsdp: parity PASS; one epoch, its checkpoint sharded"


def check_allreduce_nccl(check: Check, out: Path) -> str:
    done = gpulab(["bench", "allreduce", "--preset", "quick", "--devices", "cuda:0,cuda:1", "--out", str(out / "bench")],
                  out / "bench-allreduce.log")
    data = json.loads((out / "bench" / "allreduce.json").read_text())
    if done.returncode != 0 or not all(c["passed"] for c in data["checks"]):
        raise Failed(f"exit {done.returncode}; checks {data['checks']}")
    return data["summary"]["headline"]


def check_plan_gpu(check: Check, out: Path) -> str:
    """The planner's GPU path: CUDA-event step profile, named links for devices and machines."""
    plan_dir = out / "plan-gpu"
    # one row per kind of link (8 GPUs over nvlink4, 2 machines over ndr400): each more row measures
    # another step profile (the 2026-11-27 H100 run with 6 rows ran past 65 s)
    done = gpulab(["plan", "--devices", "cuda", "--device-link", "nvlink4", "--devices-per-node", "8",
                   "--nodes", "1", "2", "--link", "ndr400", "--no-sweep", "--out", str(plan_dir)], out / "plan-gpu.log")
    if done.returncode != 0:
        raise Failed(f"gpulab plan exited {done.returncode}; see plan-gpu.log")
    plan = json.loads((plan_dir / "plan.json").read_text())
    profile = plan["profiles"][0]
    seen = (f"one GPU step {profile['step_s'] * 1e3:.2f} ms at batch {profile['batch']} on {profile['device']}, "
            f"backward {profile['backward_s'] * 1e3:.2f} ms; {len(plan['rows'])} rows")
    if not profile["device"].startswith("cuda") or not 0 < profile["backward_s"] < profile["step_s"]:
        raise Failed(seen)
    return seen


def check_profile_memory(check: Check, out: Path) -> str:
    """The memory split on CUDA (the caching allocator's counts + torch.profiler's events) against
    what memory_known.py counts itself, as tests/monitor/test_memory.py checks it on a CPU."""
    truth_file = out / "memory-truth.json"
    report = profile_report("memory_known.py", out / "profile-memory", out / "profile-memory.log", "cnn",
                            str(truth_file), "cuda")
    truth, memory = json.loads(truth_file.read_text()), report["memory"]
    ratios = {k: memory["sizes"][k] / v for k, v in truth.items()}
    seen = (f"peak {memory['peak'] / 2**20:.1f} MiB on {memory['device']} in {memory['peak_phase']}; measured/truth "
            + ", ".join(f"{k} {r:.3f}" for k, r in ratios.items()))
    if not memory["device"].startswith("cuda") or any(abs(r - 1) > 0.10 for r in ratios.values()):
        raise Failed(seen)
    return seen


def check_profile_oom(check: Check, out: Path) -> str:
    """torch.cuda.OutOfMemoryError as the first finding: the planted line, the largest category."""
    report = profile_report("out_of_memory.py", out / "profile-oom", out / "profile-oom.log", "--cuda", exit_code=1)
    top = top_finding(report)
    seen = f"top finding {top['cause']} at {top.get('where')}: {top.get('evidence', '')[:200]}"
    if (top["cause"] != "out_of_memory" or not str(top.get("where")).endswith(planted_site("out_of_memory.py"))
            or "on cuda" not in top["evidence"] or "the largest is activations" not in top["evidence"]):
        raise Failed(seen)
    return seen


def check_plan_fits_cuda(check: Check, out: Path) -> str:
    """gpulab.plan.fits on CUDA enforces the budget through the caching allocator: LeNet at batch
    2048 fits a budget 10% over its measured peak, and not one 20% under it."""
    runs = {}
    for name, budget in (("measure", 80 * 2**30), ("over", None), ("under", None)):
        peak = runs.get("measure", {}).get("peak") or 0
        budget = budget or int(peak * (1.1 if name == "over" else 0.8))
        spec = {"cfg": {"model": "lenet", "devices": "cuda"}, "batch": 2048, "budget": budget,
                "out": str(out / f"fits-{name}.json")}
        done = run([sys.executable, "-m", "gpulab.plan.fits", json.dumps(spec)], out / f"fits-{name}.log", timeout=300)
        if done.returncode != 0:
            raise Failed(f"gpulab.plan.fits exited {done.returncode}; see fits-{name}.log")
        runs[name] = json.loads((out / f"fits-{name}.json").read_text())
    seen = (f"LeNet batch 2048 peak {runs['measure']['peak'] / 2**20:.1f} MiB; fits 110%: {runs['over']['fits']}, "
            f"fits 80%: {runs['under']['fits']} ({runs['under']['error']})")
    if not runs["over"]["fits"] or runs["under"]["fits"] or not runs["under"]["error"]:
        raise Failed(seen)
    return seen


SAMPLER_PROBE = textwrap.dedent("""
    import json, sys, threading, time, torch
    from gpulab.monitor.parent.sampler import GPM_MIN_GAP_S, Sampler
    s = Sampler(interval_s=0.05).start()
    x = torch.randn(4096, 4096, device="cuda")
    t_end = time.monotonic() + 2.0
    while time.monotonic() < t_end:
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    time.sleep(0.3)
    s.stop()
    rows = [r["gpus"][0] for r in s.samples if r["gpus"]]
    gpm = [r for r in rows if r.get("sm_active_pct") is not None]
    print(json.dumps({"samples": len(rows), "gpm_rows": len(gpm), "gpm_min_gap_s": GPM_MIN_GAP_S,
                      "sm_active_max": max((r["sm_active_pct"] for r in gpm), default=None),
                      "process_sm_max": max((r.get("process_sm_pct") or 0 for r in rows), default=None),
                      "kernel_active_max": max((r.get("kernel_active_pct") or 0 for r in rows), default=None),
                      "status": s.gpu.status, "unsupported": s.gpu.unsupported()}))
""")


def check_sampler_gpm(check: Check, out: Path) -> str:
    done = run([sys.executable, "-c", SAMPLER_PROBE], out / "sampler-gpm.log", timeout=60)
    if done.returncode != 0:
        raise Failed(f"exit {done.returncode}; see sampler-gpm.log")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    seen = (f"{r['samples']} samples at 50 ms, {r['gpm_rows']} with GPM (pairs >= {r['gpm_min_gap_s']} s apart), "
            f"SM active max {r['sm_active_max']}%, this process's SM share max {r['process_sm_max']}%, "
            f"device-wide kernel-active max {r['kernel_active_max']}%")
    too_many = r["gpm_rows"] > r["samples"] * 0.05 / r["gpm_min_gap_s"] + 1
    if not r["gpm_rows"] or too_many or not r["sm_active_max"] or not r["process_sm_max"]:
        raise Failed(seen)
    return seen


KILL_PROBE_SCRIPT = textwrap.dedent("""
    import time, torch
    x = torch.randn(4096, 4096, device="cuda")
    opt_end = time.monotonic() + 120
    while time.monotonic() < opt_end:
        x = (x @ x).tanh_()
        torch.cuda.synchronize()
""")


def check_kill_frees_gpu(check: Check, out: Path) -> str:
    import psutil

    script = out / "kill_probe.py"
    script.write_text(KILL_PROBE_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(out / "kill-frees-gpu.log", "w") as log:
        parent = subprocess.Popen([sys.executable, "-m", "gpulab", "profile", "--out", str(out / "profile-killed"), "--",
                                   sys.executable, str(script)], cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            job = _wait_for_gpu_child(parent.pid, timeout_s=60)
            parent.send_signal(signal.SIGKILL)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 30 and (psutil.pid_exists(job) and psutil.Process(job).status() != "zombie"
                                                  or job in _gpu_pids()):
                time.sleep(0.1)
            freed_after = time.monotonic() - t0
        finally:
            parent.kill()
            parent.wait()
    if job in _gpu_pids() or psutil.pid_exists(job) and psutil.Process(job).status() != "zombie":
        raise Failed(f"the job (pid {job}) still runs or holds the GPU {freed_after:.0f} s after kill -9 of gpulab profile")
    return f"the job (pid {job}) ended and left the GPU {freed_after:.1f} s after kill -9 of gpulab profile"


def _wait_for_gpu_child(parent_pid: int, timeout_s: float) -> int:
    import psutil

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        children = {c.pid for c in psutil.Process(parent_pid).children(recursive=True)}
        on_gpu = children & _gpu_pids()
        if on_gpu:
            time.sleep(2.0)  # let it run under the recorder a little
            return on_gpu.pop()
        time.sleep(0.2)
    raise Failed("the profiled job never showed up on the GPU")


def _gpu_pids() -> set[int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        pids = set()
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            pids |= {p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
        return pids
    finally:
        pynvml.nvmlShutdown()



# ----------------------------------------------------------------------------- pytest: one row per test


@dataclass
class PytestEvents:
    """What one pytest process has said so far through the plugin at the end of this file."""

    path: Path
    lines_read: int = 0
    collected: list[str] | None = None
    running: str | None = None  # started, not finished
    running_since: float = 0.0
    finished: set[str] = field(default_factory=set)

    def new_events(self) -> list[dict]:
        """The events written since the last call; a line still being written waits for the next."""
        if not self.path.exists():
            return []
        events = []
        for line in self.path.read_text().splitlines()[self.lines_read:]:
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break
            self.lines_read += 1
        return events

    def unfinished(self) -> list[str]:
        return [t for t in self.collected or () if t not in self.finished and t != self.running]


def tests_as_rows(targets: list[str]) -> Callable[[Check, Path], str]:
    def check_fn(check: Check, out: Path) -> str:
        return run_pytest_group(check, out, targets)

    return check_fn


def run_pytest_group(check: Check, out: Path, targets: list[str], pytest_args: tuple[str, ...] = ()) -> str:
    """pytest on `targets`, each test a row of its own the moment it ends. A pytest that dies (a
    segfault inside a test) costs that test only: the tests it did not reach run in a fresh pytest."""
    todo, exits = list(targets), []
    t0 = time.monotonic()
    while True:
        attempt = len(exits) + 1
        events = PytestEvents(out / f"{check.name}-{attempt}.events.jsonl")
        code, cut = _stream_pytest(check, out, todo, events, attempt, pytest_args)
        exits.append(code)
        if events.running is not None:  # the test pytest was in when it died or was stopped
            why = ("stopped: the budget ran out during this test" if cut
                   else f"pytest died ({exit_name(code)}) during this test; see {check.name}-{attempt}.log")
            _add_test_row(check, events.running, "error", why, time.monotonic() - events.running_since,
                          f"{check.name}-{attempt}.log")
        if events.collected is None:  # it never got to the tests (see its log)
            break
        progressed = events.finished or events.running is not None
        todo = events.unfinished()
        if cut or code in (0, 1, 5) or not todo or not progressed:
            break
    if cut:
        for test in todo:
            _add_test_row(check, test, "not run (budget)", "the budget ran out before this test", 0.0, None)
    return _pytest_verdict(check, exits, cut, time.monotonic() - t0)


def _stream_pytest(check: Check, out: Path, targets: list[str], events: PytestEvents, attempt: int,
                   pytest_args: tuple[str, ...]) -> tuple[int | None, bool]:
    """One pytest process; its events turned into rows while it runs. (exit code, cut by the budget?)"""
    events.path.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "gpu_check",
           "--continue-on-collection-errors", f"--basetemp={out / f'{check.name}-{attempt}-tmp'}", *pytest_args, *targets]
    log_name = f"{check.name}-{attempt}.log"
    reports_seen: set[Path] = set()
    cut = False
    with open(out / log_name, "w") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        proc = start(cmd, log, subprocess.STDOUT, extra_path=(ROOT / "scripts",), **{EVENTS_ENV: str(events.path)})
        try:
            while proc.poll() is None:
                _take_events(check, events, out / f"{check.name}-{attempt}-tmp", reports_seen, log_name)
                if BUDGET.left() <= 0:
                    stop_process_group(proc)
                    cut = True
                    break
                time.sleep(0.3)
        except BaseException:  # SIGTERM or Ctrl-C: pytest goes too
            stop_process_group(proc, grace_s=2.0)
            raise
        finally:
            forget(proc)
    _take_events(check, events, out / f"{check.name}-{attempt}-tmp", reports_seen, log_name)
    return proc.returncode, cut


def _take_events(check: Check, events: PytestEvents, basetemp: Path, reports_seen: set[Path], log_name: str) -> None:
    for event in events.new_events():
        if event["event"] == "collected":
            events.collected = event["tests"]
        elif event["event"] == "start":
            events.running, events.running_since = event["test"], time.monotonic()
        elif event["event"] == "done":
            events.running = None
            events.finished.add(event["test"])
            # The gpulab profile reports this test wrote (tests run one at a time: the new ones are its).
            reports = sorted(set(basetemp.rglob("report.json")) - reports_seen) if basetemp.exists() else []
            reports_seen.update(reports)
            evidence = [*event["truth"], *(profile_evidence(p) for p in reports)]
            seen = "; ".join([event["message"]] * bool(event["message"]) + evidence) or "passed"
            _add_test_row(check, event["test"], event["outcome"], seen, event["seconds"], log_name)


def profile_evidence(report_path: Path) -> str:
    """One line of what a gpulab profile report said: the top finding, the device's busy share."""
    try:
        report = json.loads(report_path.read_text())
    except (OSError, ValueError) as e:
        return f"{report_path.parent.name}: unreadable report ({type(e).__name__})"
    command = report.get("command") or []
    module = [" ".join(command[i + 1:i + 3]) for i, a in enumerate(command) if a == "-m"]  # python -m gpulab train
    script = next((Path(a).name for a in command if a.endswith(".py")), module[0] if module else "?")
    top = top_finding(report)
    busy = report.get("device_busy") or {}
    where = str(top.get("where") or "-").rsplit("/", 1)[-1]
    return (f"{script}: exit {report.get('exit_code')}, top {top['cause']} {top.get('share', 0):.0%} at {where}, "
            f"device busy {busy.get('share', 0):.0%} ({busy.get('source', '?')})")


def _add_test_row(check: Check, test: str, status: str, seen: str, seconds: float, log: str | None) -> None:
    row = Check(test, check.needs, "passes (docs/gpu-checklist.md says what it checks)", None, status=status,
                seen=seen, seconds=round(seconds, 1), log=log, part_of=check.name)
    check.tests.append(row)
    check.row_done(row)


def _pytest_verdict(check: Check, exits: list[int | None], cut: bool, seconds: float) -> str:
    counts = Counter(row.status for row in check.tests)
    words = {"pass": "passed", "fail": "failed", "error": "errors"}
    summary = ", ".join(f"{n} {words.get(status, status)}" for status, n in counts.most_common()) or "no test ran"
    summary += f" in {seconds:.0f} s"
    if len(exits) > 1:
        summary += f"; pytest ran {len(exits)} times (exits {', '.join(map(exit_name, exits))}): it died in a test"
    if cut:
        raise BudgetSpent(summary)
    if counts["fail"] or counts["error"] or not check.tests or exits[-1] not in (0, 1, 5):
        if not check.tests:
            summary = f"pytest exited {exit_name(exits[-1])} before any test; see {check.name}-1.log"
        raise Failed(summary)
    return summary


# ----------------------------------------------------------------------------- profile-no-crash (--repeat)


def unexpected_exits(exit_codes: dict[str, list], expected: int = 0) -> dict[str, list]:
    """Per script, the exit codes that differ from the script's own (`expected`): 139 or -11 is a
    segmentation fault, "timeout" a run that hung and was stopped. Scripts without any are left out."""
    bad = {script: [c for c in codes if c != expected] for script, codes in exit_codes.items()}
    return {script: codes for script, codes in bad.items() if codes}


def describe_exits(exit_codes: dict[str, list], expected: int = 0) -> str:
    bad = unexpected_exits(exit_codes, expected)
    runs = sum(len(codes) for codes in exit_codes.values())
    parts = []
    for script, codes in exit_codes.items():
        part = f"{script.removesuffix('.py')} {len(codes) - len(bad.get(script, []))}/{len(codes)}"
        if script in bad:
            part += " (" + ", ".join(f"{n}x {exit_name(code)}" for code, n in Counter(bad[script]).most_common()) + ")"
        parts.append(part)
    return f"{sum(map(len, bad.values()))} of {runs} runs exited otherwise than the script ({expected}): " + "; ".join(parts)


def profile_repeatedly(scripts: tuple[str, ...], repeat: int, jobs: int, folder: Path) -> dict[str, list]:
    """Each script `repeat` times under gpulab profile, `jobs` at a time: the exit codes per script.
    Runs the budget left no time for are not counted. Clean runs leave nothing behind; a bad one
    keeps its log and profile."""
    folder.mkdir(parents=True, exist_ok=True)
    codes: dict[str, list] = {script: [] for script in scripts}
    lock, stopping = threading.Lock(), threading.Event()

    def one_run(script: str, i: int) -> None:
        if stopping.is_set() or BUDGET.left() <= 0:
            return
        name, *args = script.split()
        out, log = folder / f"{name.removesuffix('.py')}-{i}", folder / f"{name.removesuffix('.py')}-{i}.log"
        try:
            command = ["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / name), *args]
            code = gpulab(command, log, timeout=180).returncode
        except BudgetSpent:
            return
        except Failed:
            code = "timeout"
        with lock:
            codes[script].append(code)
        if code == 0:
            shutil.rmtree(out, ignore_errors=True)
            log.unlink(missing_ok=True)

    # Round-robin order: a run cut by the budget still leaves every script some runs.
    runs = [(script, i) for i in range(repeat) for script in scripts]
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        for _ in pool.map(lambda r: one_run(*r), runs):
            pass
    except BaseException:  # SIGTERM or Ctrl-C: start no more runs, and stop the running ones now
        stopping.set()
        stop_live_processes()
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return codes


def no_crash_check(repeat: int, jobs: int) -> Check:
    def check_fn(check: Check, out: Path) -> str:
        codes = profile_repeatedly(PLANTED_CUDA_SCRIPTS, repeat, jobs, out / "no-crash")
        check.details["exit_codes"] = codes
        seen = describe_exits(codes)
        if unexpected_exits(codes):
            raise Failed(seen)
        runs, wanted = sum(map(len, codes.values())), repeat * len(PLANTED_CUDA_SCRIPTS)
        if runs < wanted:
            raise BudgetSpent(f"{seen}; only {runs} of {wanted} runs before the budget ran out")
        return seen

    return Check("profile-no-crash", "gpu",
                 f"each planted CUDA script {repeat}x under `gpulab profile` ({jobs} at a time): every run exits 0, "
                 "as the script does alone - no 139 (SIGSEGV), no other code, no hang", check_fn)


# ----------------------------------------------------------------------------- compiled training (issue 35)
# Minutes each (torch.compile's first compile, then whole training runs): not in the default list,
# added by --compile (or named with --only).

COMPILE_TESTS = ["tests/parallel/test_graphed.py",
                 "tests/monitor/test_gpu.py::test_a_cuda_graph_skipped_for_a_mutated_input_is_named_with_its_fix",
                 "tests/monitor/test_gpu.py::test_a_cuda_graph_recorded_again_for_a_weight_in_new_memory_is_named_with_its_fix",
                 "tests/monitor/test_gpu.py::test_replays_of_a_recorded_whole_step_are_the_steps"]


def check_compile_parity(mode: str) -> Callable[[Check, Path], str]:
    def check_fn(check: Check, out: Path) -> str:
        return parity("cuda", out / f"compile-parity-{mode}.log", "--compile", mode)

    return check_fn


def check_compile_parity_without_tf32(check: Check, out: Path) -> str:
    """The float32 line of `--compile graphs --check-parity` read 3.5e-6 against 5.4e-8 of
    reordering noise on an H200 (and from 3.5e-8 to 8.0e-5 between calls), while float64 passed.
    The suspect is TF32, which cuDNN's convolutions use by default in float32: the recorded and
    the eager step may pick other algorithms, each rounding to TF32 its own way. With
    NVIDIA_TF32_OVERRIDE=0 (TF32 off in cuDNN and cuBLAS) the float32 line should be within 10x
    of the noise; if it is not, TF32 is not the cause."""
    seen = parity("cuda", out / "compile-parity-graphs-no-tf32.log", "--compile", "graphs", NVIDIA_TF32_OVERRIDE="0")
    if "MORE than" in seen:
        raise Failed(f"TF32 off, the float32 line still exceeds 10x the noise: {seen}")
    return seen


def check_bench_training(check: Check, out: Path) -> str:
    """`gpulab bench training --rounds 1` on the GPU (10 epochs, one round: three would outlast a
    lease; each contender a first run on empty caches and a second): every contender trains every epoch;
    every contender but the textbook (gpulab's: the default, which records the step, --compile off, on
    and graphs; the script by hand) reaches >= 0.90. The whole-process ratios to the textbook,
    first and second run, the times to the first step and to 0.90 are what the JSON records (the
    targets on one GPU: >= 2x first run, >= 3x second run, whole process)."""
    bench = out / "bench-training"
    done = gpulab(["bench", "training", "--devices", "cuda", "--rounds", "1", "--out", str(bench)], out / "bench-training.log",
                  timeout=560)
    data = json.loads((bench / "training.json").read_text())
    rows = [r for r in data["tables"]["training"]["rows"] if r["device"].startswith("cuda")]
    check.details["rows"] = rows
    check.details["floor"] = data["summary"]["devices"]
    seen = "; ".join(f"{r['contender']} ({r['run']} run): {r['wall_s']:.1f} s whole process ({r['ratio']:.2f}x), "
                     f"first step {r['first_step_s'] or 0:.1f} s, to 0.90 {r['to_acc_s'] or 0:.1f} s, "
                     f"{r['epoch_s']:.2f} s/epoch, "
                     f"{r['train_s']:.3f} s training ({r['train_ratio']:.1f}x), "
                     f"compile {r['compile_s']:.1f} s, acc {r['test_acc']:.3f}" for r in rows)
    failed = [c for c in data.get("checks", []) if not c["passed"]]
    ours = [r for r in rows if r["contender"] != "textbook"]  # the default records the step; eager; compiled
    if done.returncode != 0 or failed or not ours or any(r["test_acc"] < 0.90 for r in ours):
        raise Failed(f"exit {done.returncode}; failed checks {failed}; {seen}")
    return seen


PROFILE_OVERHEAD_TARGET = 1.10  # profiled / plain: what the profiler may add to a steady step and to compiling


def check_profile_overhead(check: Check, out: Path) -> str:
    """benchmarks/profile_overhead.py's GPU rows, 3 rounds: the LeNet-sized eager loop and the
    compiled net with a graph break, plain and under `gpulab profile` alternating. Passes when the
    compiled net's steady step and compiling are within 1.10x of plain and the fixed cost within
    0.5 s (medians); every ratio is in the details."""
    results = out / "profile-overhead.json"
    done = run([sys.executable, str(ROOT / "benchmarks" / "profile_overhead.py"), "--only", "optimizer-cuda",
                "compiled-cuda", "--variants", "this", "--rounds", "3", "--json", str(results)],
               out / "profile-overhead.log", timeout=420)
    if done.returncode != 0:
        raise Failed(f"exit {exit_name(done.returncode)} (see profile-overhead.log)")
    data = json.loads(results.read_text())
    check.details = data
    median = {f"{name} {key}": statistics.median(ratios) for name, by_variant in data["scripts"].items()
              for key, ratios in by_variant["this"].items() if key.endswith("_s") and key != "wall_added_s"}
    fixed = statistics.median(data["fixed_s"]["this"])
    seen = f"fixed cost +{fixed:.2f} s; " + "; ".join(f"{k} x{v:.2f}" for k, v in median.items())
    over = [k for k in ("compiled-cuda step_s", "compiled-cuda compile_s") if median.get(k, 0) > PROFILE_OVERHEAD_TARGET]
    if over or fixed > 0.5:
        raise Failed(f"over the targets ({', '.join(over) or 'fixed cost'}): {seen}")
    return seen


def check_profile_train(compile: str) -> Callable[[Check, Path], str]:
    """`gpulab profile` of `gpulab train --compile MODE` on the GPU: how busy the card is (the
    kernel window's share), and what the profiler says first."""
    def check_fn(check: Check, out: Path) -> str:
        folder = out / f"profile-train-{compile}"
        done = gpulab(["profile", "--out", str(folder), "--", sys.executable, "-m", "gpulab", "train", "--devices",
                       "cuda", "--epochs", "2", "--compile", compile, "--out", str(out / f"train-{compile}")],
                      out / f"profile-train-{compile}.log")
        if done.returncode != 0:
            raise Failed(f"gpulab profile exited {exit_name(done.returncode)} (see profile-train-{compile}.log)")
        report = json.loads((folder / "report.json").read_text())
        check.details["findings"] = [{k: f.get(k) for k in ("cause", "share", "where", "evidence")}
                                     for f in report["findings"][:4]]
        check.details["device_busy"] = report.get("device_busy")
        return profile_evidence(folder / "report.json")

    return check_fn


def compile_checks() -> list[Check]:
    return [
        Check("compile-parity-record", "gpu", "gpulab train --devices cuda --compile record --check-parity (the "
              "default on one GPU: the eager step recorded): parity PASS", check_compile_parity("record")),
        Check("compile-parity-graphs", "gpu", "gpulab train --devices cuda --compile graphs --check-parity: parity PASS",
              check_compile_parity("graphs")),
        Check("compile-parity-graphs-no-tf32", "gpu", "the same with NVIDIA_TF32_OVERRIDE=0: float32 within 10x of "
              "the reordering noise (is TF32 why it was not?)", check_compile_parity_without_tf32),
        Check("bench-training", "gpu", "gpulab bench training --devices cuda --rounds 1 (10 epochs): every run trains; "
              "gpulab's test acc >= 0.90; ratios recorded (target >= 10x the textbook per epoch)", check_bench_training),
        Check("profile-train-graphs", "gpu", "gpulab profile -- gpulab train --compile graphs: exit 0, the card's busy share",
              check_profile_train("graphs")),
        Check("tests-compile", "gpu", f"pytest {' '.join(COMPILE_TESTS)}: every test passes (a row per test)",
              tests_as_rows(COMPILE_TESTS)),
        Check("compile-parity-on", "gpu", "gpulab train --devices cuda --compile on --check-parity: parity PASS",
              check_compile_parity("on")),
        Check("profile-train-off", "gpu", "gpulab profile -- gpulab train --compile off: exit 0, the card's busy share",
              check_profile_train("off")),
        Check("profile-overhead-gpu", "gpu", "benchmarks/profile_overhead.py on cuda, 3 rounds: the compiled net's "
              "steady step and compiling <= 1.10x plain, fixed cost <= 0.5 s", check_profile_overhead),
    ]


# ----------------------------------------------------------------------------- the list, most important first


def all_checks(repeat: int = 0, jobs: int = 4, compile: bool = False) -> list[Check]:
    checks = [
        Check("tests-profiler", "gpu", f"pytest {' '.join(PROFILER_TESTS)}: every test passes (a row per test)",
              tests_as_rows(PROFILER_TESTS)),
        Check("train-1gpu", "gpu", "gpulab train --devices cuda, 3 epochs: exit 0, test accuracy >= 0.80", check_train),
        Check("parity-1gpu", "gpu", "gpulab train --devices cuda --check-parity: parity PASS", check_parity_1),
        Check("parity-2gpu", "2 gpus", "gpulab train --devices cuda:0,cuda:1 --check-parity: parity PASS", check_parity_2),
        Check("launch-nccl", "2 gpus", "gpulab launch -n 2 -- --check-parity (NCCL): parity PASS", check_launch_nccl),
        Check("fsdp-nccl", "2 gpus", "gpulab launch -n 2 -- --shard fsdp: parity PASS, then an epoch with a sharded checkpoint",
              check_fsdp_nccl),
        Check("allreduce-nccl", "2 gpus", "gpulab bench allreduce on cuda:0,cuda:1: every algorithm's sum checks",
              check_allreduce_nccl),
        Check("profile-memory", "gpu", "memory_known.py cnn on cuda: each category within 10% of what the script counts",
              check_profile_memory),
        Check("profile-oom", "gpu", "out_of_memory.py --cuda: out_of_memory first, at the planted line, largest activations",
              check_profile_oom),
        Check("devices", "nothing", "`gpulab devices --json` has a verdict; 'ok' exactly when torch sees a GPU", check_devices),
        Check("devices-hidden", "gpu", "with CUDA_VISIBLE_DEVICES='' the verdict names the variable and is not ok",
              check_devices_hidden),
        Check("plan-gpu", "gpu", "gpulab plan --devices cuda (CUDA-event step profile, nvlink4/ndr400 links): a plan on cuda",
              check_plan_gpu),
        Check("plan-fits-cuda", "gpu", "gpulab.plan.fits: LeNet batch 2048 fits 110% of its peak, not 80% (allocator limit)",
              check_plan_fits_cuda),
        Check("sampler-gpm", "hopper", "GPM metrics read, pairs >= 0.15 s apart at a 50 ms interval; per-process SM share",
              check_sampler_gpm),
        Check("kill-frees-gpu", "gpu", "kill -9 of gpulab profile: the job ends and leaves the GPU within 30 s",
              check_kill_frees_gpu),
        Check("tests-devices-bench", "gpu", f"pytest {' '.join(OTHER_GPU_TESTS)}: every test passes (a row per test)",
              tests_as_rows(OTHER_GPU_TESTS)),
    ]
    if repeat:
        checks.append(no_crash_check(repeat, jobs))
    if compile:
        checks += compile_checks()
    return checks


# ----------------------------------------------------------------------------- the runner


class Runner:
    """Runs the checks in order within the budget; the JSON is rewritten whenever a row changes
    (a check starts or ends, a test ends), so a run killed from outside leaves every finished result."""

    def __init__(self, checks: list[Check], machine: Machine, out: Path, budget_s: float = math.inf,
                 echo: Callable[[str], None] = lambda line: print(line, flush=True), started: float | None = None):
        """`started`: when the budget began (gpu_check's start: a lease counts the probe too); default now."""
        self.checks, self.machine, self.out, self.budget_s, self.echo = checks, machine, out, budget_s, echo
        self.path = out / "gpu_check.json"
        self.complete = False
        self._t0 = time.monotonic() if started is None else started

    def run_all(self) -> None:
        BUDGET.start(self.budget_s, at=self._t0)
        self.save()
        for check in self.checks:
            self.run_one(check)
        self.complete = True
        self.save()

    def run_one(self, check: Check) -> None:
        if not self.machine.has(check.needs):
            check.status, check.seen = "skipped", f"needs {check.needs}"
        elif BUDGET.left() <= 0:
            check.status, check.seen = "not run (budget)", f"the budget (--budget-s {self.budget_s:g}) was spent"
        else:
            self._execute(check)
        self.save()
        self.echo(f"  {check.status:8} {check.name:24} {check.seen}")

    def _execute(self, check: Check) -> None:
        check.status, check.row_done = "running", self._test_row_done
        self.save()
        t0 = time.monotonic()
        try:
            check.seen, check.status = check.run(check, self.out), "pass"
        except Failed as e:
            check.status, check.seen = "fail", str(e)
        except BudgetSpent as e:
            check.status, check.seen = "error", f"cut by the budget (--budget-s {self.budget_s:g}): {e}"
        except Exception as e:  # a broken check is reported, and the others still run
            check.status, check.seen = "error", f"{type(e).__name__}: {e}"
        except BaseException as e:  # SIGTERM, Ctrl-C: say where it happened, then stop
            check.status, check.seen = "error", f"gpu_check was stopped during this check ({type(e).__name__} {e})"
            raise
        finally:
            check.seconds = round(time.monotonic() - t0, 1)

    def _test_row_done(self, row: Check) -> None:
        self.save()
        self.echo(f"    {row.status:8} {row.name} ({row.seconds:.0f} s) {row.seen}")

    def rows(self) -> list[Check]:
        """The checks in order, each pytest check followed by its tests."""
        return [r for check in self.checks for r in (check, *check.tests)]

    def leaves(self) -> list[Check]:
        """What the summary counts: each test, and each check that is not a group of tests."""
        return [r for check in self.checks for r in (check.tests or [check])]

    def save(self) -> None:
        record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": self.machine.facts,
                  "budget_s": self.budget_s, "elapsed_s": round(time.monotonic() - self._t0, 1),
                  "complete": self.complete, "checks": [r.as_json() for r in self.rows()]}
        write_atomically(self.path, json.dumps(record, indent=2))


def write_atomically(path: Path, text: str) -> None:
    """Whole or not at all: a reader (or a kill) never sees half a file."""
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(f.name, path)


def _raise_terminated(signum, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="where the JSON and logs go (default gpu-check/)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these checks")
    parser.add_argument("--budget-s", type=float, default=290.0, metavar="SECONDS",
                        help="start no check this many seconds after gpu_check started; stop the one running then "
                             "(default 290)")
    parser.add_argument("--repeat", type=int, default=0, metavar="N",
                        help="add profile-no-crash: each planted CUDA script N times under gpulab profile (default 0: off)")
    parser.add_argument("--jobs", type=int, default=4, help="profile-no-crash runs at a time (default 4)")
    parser.add_argument("--compile", action="store_true",
                        help="add compiled training (issue 35: parity, bench training, profiled runs; minutes each)")
    args = parser.parse_args(argv)
    if not args.budget_s > 0:
        parser.error(f"--budget-s {args.budget_s:g}: give a number of seconds above 0")
    if args.repeat < 0:
        parser.error(f"--repeat {args.repeat}: give 0 (off) or more")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give 1 or more")
    known = [c.name for c in all_checks(repeat=1, compile=True)]
    unknown = set(args.only or ()) - set(known)
    if unknown:
        parser.error(f"unknown check(s) {sorted(unknown)}; known: {', '.join(known)}")
    if "profile-no-crash" in (args.only or ()) and not args.repeat:
        parser.error("profile-no-crash runs each planted script --repeat N times: give --repeat N")
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    named_compile = set(args.only or ()) & {c.name for c in compile_checks()}
    every = all_checks(args.repeat, args.jobs, compile=args.compile or bool(named_compile))
    checks = [c for c in every if not args.only or c.name in args.only]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = Machine.probe()
    print(f"gpu_check: {machine.gpus} GPU(s) {machine.name}  torch {machine.facts['torch']}  "
          f"budget {args.budget_s:g} s", flush=True)
    return run_checks(Runner(checks, machine, out, args.budget_s, started=started))


def run_checks(runner: Runner) -> int:
    """Every check, then the summary. On SIGTERM (a lease's timeout) or Ctrl-C: stop the commands
    running, mark the check they belong to, keep the JSON; exit 143 or 130."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        runner.run_all()
    except (Terminated, KeyboardInterrupt) as e:
        stop_live_processes()
        runner.save()
        print(f"gpu_check stopped ({type(e).__name__} {e}); wrote what had finished to {runner.path}", flush=True)
        return 143 if isinstance(e, Terminated) else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return summarize(runner)


def summarize(runner: Runner) -> int:
    rows = runner.leaves()
    failed = [r.name for r in rows if r.status in ("fail", "error")]
    skipped = [r for r in rows if r.status == "skipped"]
    unrun = [r for r in rows if r.status == "not run (budget)"]
    if not runner.machine.gpus:
        print(f"no GPU: {len(skipped)} checks skipped")
    elif skipped:
        print(f"{len(skipped)} skipped: " + "; ".join(f"{r.name} ({r.seen})" for r in skipped))
    if unrun:
        print(f"{len(unrun)} not run (budget): " + ", ".join(r.name for r in unrun))
    named = f": {', '.join(failed)}" if failed else ""
    print(f"{sum(r.status == 'pass' for r in rows)} passed, {len(failed)} failed{named}; wrote {runner.path}")
    return 1 if failed else 0


# ----------------------------------------------------------------------------- inside pytest
# run_pytest_group starts pytest with `-p gpu_check` and $GPU_CHECK_EVENTS set: these hooks then
# append one JSON line per event to that file as it happens (a test starts, a test ends), so a
# pytest that dies in a test (a segfault) leaves every finished test's result - and which test it
# died in. pytest's --junitxml is written only at the end, and a crash loses it. Without the
# variable (this module imported anywhere else) the hooks do nothing.

_results: dict[str, dict] = {}
_where: dict[str, Path] = {}  # pytest's rootdir (test ids are relative to it) and the directory it was started in


def pytest_configure(config) -> None:
    _where.update(root=Path(config.rootpath), cwd=Path(config.invocation_params.dir))


def _test_id(nodeid: str) -> str:
    """A test's id as pytest takes it on a command line started where this one was: gpu_check
    runs again, by these ids, the tests a pytest that died did not reach."""
    file_part, sep, rest = nodeid.partition("::")
    path = _where["root"] / file_part
    return f"{path.relative_to(_where['cwd']) if path.is_relative_to(_where['cwd']) else path}{sep}{rest}"


def _emit(event: dict) -> None:
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(event) + "\n")


def _one_line(text: str, limit: int = 400) -> str:
    return " ".join(text.split())[:limit]


def pytest_collection_finish(session) -> None:
    _emit({"event": "collected", "tests": [_test_id(item.nodeid) for item in session.items]})


def pytest_collectreport(report) -> None:
    if report.failed:
        where = _test_id(report.nodeid) if report.nodeid else "(collection)"
        _emit({"event": "done", "test": where, "outcome": "error", "message": _one_line(str(report.longrepr)),
               "seconds": 0.0, "truth": []})


def pytest_runtest_logstart(nodeid: str, location) -> None:
    _results[nodeid] = {"event": "done", "test": _test_id(nodeid), "outcome": "pass", "message": "", "seconds": 0.0,
                        "truth": []}
    _emit({"event": "start", "test": _test_id(nodeid)})


def pytest_runtest_logreport(report) -> None:
    result = _results.get(report.nodeid)
    if result is None:
        return
    result["seconds"] += report.duration
    if report.when == "call":  # the profiled scripts' TRUTH lines, captured from their stdout
        result["truth"] = [line for line in report.capstdout.splitlines() if line.startswith("TRUTH")]
    if report.skipped and result["outcome"] == "pass":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        result["outcome"], result["message"] = "skipped", _one_line(reason.removeprefix("Skipped: "))
    elif report.failed and result["outcome"] in ("pass", "skipped"):
        crash = getattr(report.longrepr, "reprcrash", None)
        result["outcome"] = "fail" if report.when == "call" else "error"
        result["message"] = _one_line(crash.message if crash is not None else str(report.longrepr))


def pytest_runtest_logfinish(nodeid: str, location) -> None:
    result = _results.pop(nodeid, None)
    if result is not None:
        _emit(result)


if __name__ == "__main__":
    sys.exit(main())
