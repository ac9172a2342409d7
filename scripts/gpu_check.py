#!/usr/bin/env python3
"""Run every check of gpulab's GPU paths, compare each with its expected result, write one JSON.

    python3 scripts/gpu_check.py [--out DIR] [--only NAME ...]

From the repository root of a checkout (gpulab need not be installed: src/ is put on the path).
Each check says what it needs (a GPU, two GPUs, Hopper), what it expects and what it saw; checks
whose hardware is missing are "skipped", never passed. Exit code 0 when nothing failed. Writes
DIR/gpu_check.json (default DIR: gpu-check/) and one log per check beside it. The list, in order,
with each expected result, is docs/gpu-checklist.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "monitor" / "scripts"


@dataclass
class Check:
    name: str
    needs: str  # "nothing" | "gpu" | "2 gpus" | "hopper"
    expected: str
    run: Callable[["Check", Path], str]  # returns what was seen; raises Failed when it is not the expected
    status: str = "not run"
    seen: str = ""
    seconds: float = 0.0
    log: str | None = None


class Failed(Exception):
    pass


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


# ----------------------------------------------------------------------------- running things


def gpulab(args: list[str], log: Path, timeout: float = 300, **env) -> subprocess.CompletedProcess:
    return run([sys.executable, "-m", "gpulab", *args], log, timeout, **env)


def run(cmd: list[str], log: Path, timeout: float = 300, **env_overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_overrides, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log.write_text(f"$ {' '.join(cmd)}\nexit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}")
    return done


def planted_site(script: str) -> str:
    lines = (SCRIPTS / script).read_text().splitlines()
    return f"{script}:{next(i for i, line in enumerate(lines, 1) if '# planted:' in line)}"


def profile_report(script: str, out: Path, log: Path, *args: str, exit_code: int = 0) -> dict:
    done = gpulab(["profile", "--out", str(out), "--", sys.executable, str(SCRIPTS / script), *args], log)
    if done.returncode != exit_code:
        raise Failed(f"gpulab profile exited {done.returncode}, not {exit_code} (see {log.name})")
    return json.loads((out / "report.json").read_text())


def top_finding(report: dict) -> dict:
    return report["findings"][0] if report["findings"] else {"cause": "none", "where": None}


def expect_finding(report: dict, cause: str, script: str, fix_words: tuple[str, ...] = ()) -> str:
    top = top_finding(report)
    site = planted_site(script)
    seen = (f"top finding {top['cause']} ({top.get('share', 0):.0%}) at {top.get('where')}; "
            f"device busy {report['device_busy']['share']:.0%} ({report['device_busy']['source']})")
    if top["cause"] != cause or not str(top.get("where") or "").endswith(site):
        raise Failed(seen)
    missing = [w for w in fix_words if w not in top.get("fix", "")]
    if missing:
        raise Failed(f"{seen}; the fix does not mention {missing}")
    return seen


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


def parity(devices: str, log: Path) -> str:
    done = gpulab(["train", "--devices", devices, "--check-parity"], log)
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
    done = gpulab(["plan", "--devices", "cuda", "--device-link", "nvlink4", "--devices-per-node", "1", "2", "8",
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


def profile_check(script: str, cause: str, fix_words: tuple[str, ...] = ()):
    def check_fn(check: Check, out: Path) -> str:
        name = script.removesuffix(".py")
        report = profile_report(script, out / f"profile-{name}", out / f"profile-{name}.log")
        return expect_finding(report, cause, script, fix_words)

    return check_fn


def check_annotated_step(check: Check, out: Path) -> str:
    plain = profile_report("item_every_step.py", out / "profile-item_every_step", out / "profile-item_every_step.log")
    annotated = profile_report("annotated_step.py", out / "profile-annotated_step", out / "profile-annotated_step.log")
    seen = expect_finding(annotated, "host_sync", "annotated_step.py")
    busy_plain, busy_annotated = plain["device_busy"]["share"], annotated["device_busy"]["share"]
    seen += f"; the same step without the annotation: device busy {busy_plain:.0%}"
    # An annotation counted as a kernel fills the idle gaps; the same step must read about the same.
    if busy_annotated > busy_plain + 0.05:
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
    from gpulab.monitor.sampler import GPM_MIN_GAP_S, Sampler
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


def check_gpu_tests(check: Check, out: Path) -> str:
    tests = ["tests/monitor/test_gpu.py", "tests/test_devices.py", "tests/hardware/test_describe.py",
             "tests/monitor/test_kernel_window.py", "tests/bench/test_bench_cli.py"]
    done = run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *tests], out / "pytest-gpu.log",
               timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else f"exit {done.returncode}"
    if done.returncode != 0:
        raise Failed(summary)
    return summary


CHECKS = [
    Check("devices", "nothing", "`gpulab devices --json` has a verdict; 'ok' exactly when torch sees a GPU", check_devices),
    Check("devices-hidden", "gpu", "with CUDA_VISIBLE_DEVICES='' the verdict names the variable and is not ok",
          check_devices_hidden),
    Check("train-1gpu", "gpu", "gpulab train --devices cuda, 3 epochs: exit 0, test accuracy >= 0.80", check_train),
    Check("parity-1gpu", "gpu", "gpulab train --devices cuda --check-parity: parity PASS", check_parity_1),
    Check("parity-2gpu", "2 gpus", "gpulab train --devices cuda:0,cuda:1 --check-parity: parity PASS", check_parity_2),
    Check("launch-nccl", "2 gpus", "gpulab launch -n 2 -- --check-parity (NCCL): parity PASS", check_launch_nccl),
    Check("fsdp-nccl", "2 gpus", "gpulab launch -n 2 -- --shard fsdp: parity PASS, then an epoch with a sharded checkpoint",
          check_fsdp_nccl),
    Check("allreduce-nccl", "2 gpus", "gpulab bench allreduce on cuda:0,cuda:1: every algorithm's sum checks",
          check_allreduce_nccl),
    Check("plan-gpu", "gpu", "gpulab plan --devices cuda (CUDA-event step profile, nvlink4/ndr400 links): a plan on cuda",
          check_plan_gpu),
    Check("profile-input-bound", "gpu", "slow_loader_gpu.py: input_pipeline at the planted line",
          profile_check("slow_loader_gpu.py", "input_pipeline")),
    Check("profile-host-sync", "gpu", "item_every_step.py: host_sync at the planted line",
          profile_check("item_every_step.py", "host_sync")),
    Check("profile-pageable-copy", "gpu", "pageable_copy.py: h2d_copy at the planted line, fix says pin_memory",
          profile_check("pageable_copy.py", "h2d_copy", ("pin_memory=True",))),
    Check("profile-pinned-blocking", "gpu",
          "pinned_blocking_copy.py: h2d_copy at the planted line, fix says non_blocking=True",
          profile_check("pinned_blocking_copy.py", "h2d_copy", ("non_blocking=True",))),
    Check("profile-annotated-step", "gpu",
          "annotated_step.py: host_sync at the planted line; device busy within 5 points of the same step unannotated",
          check_annotated_step),
    Check("profile-tiny-kernels", "gpu", "tiny_kernels.py: launch_overhead at the planted line",
          profile_check("tiny_kernels.py", "launch_overhead")),
    Check("profile-memory", "gpu", "memory_known.py cnn on cuda: each category within 10% of what the script counts",
          check_profile_memory),
    Check("profile-oom", "gpu", "out_of_memory.py --cuda: out_of_memory first, at the planted line, largest activations",
          check_profile_oom),
    Check("plan-fits-cuda", "gpu", "gpulab.plan.fits: LeNet batch 2048 fits 110% of its peak, not 80% (allocator limit)",
          check_plan_fits_cuda),
    Check("sampler-gpm", "hopper", "GPM metrics read, pairs >= 0.15 s apart at a 50 ms interval; per-process SM share",
          check_sampler_gpm),
    Check("kill-frees-gpu", "gpu", "kill -9 of gpulab profile: the job ends and leaves the GPU within 30 s",
          check_kill_frees_gpu),
    Check("gpu-tests", "gpu", "pytest of the GPU tests: no failure", check_gpu_tests),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("gpu-check"), help="where the JSON and logs go (default gpu-check/)")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these checks")
    args = parser.parse_args(argv)
    names = {c.name for c in CHECKS}
    unknown = set(args.only or ()) - names
    if unknown:
        parser.error(f"unknown check(s) {sorted(unknown)}; known: {', '.join(c.name for c in CHECKS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    machine = Machine.probe()
    print(f"gpu_check: {machine.gpus} GPU(s) {machine.name}  torch {machine.facts['torch']}", flush=True)
    for check in CHECKS:
        if args.only and check.name not in args.only:
            continue
        _run_check(check, machine, out)
        print(f"  {check.status:7} {check.name:24} {check.seen}", flush=True)
    _write_json(out / "gpu_check.json", machine, CHECKS)
    ran = [c for c in CHECKS if c.status != "not run"]
    failed = [c.name for c in ran if c.status in ("fail", "error")]
    skipped = [c for c in ran if c.status == "skipped"]
    if not machine.gpus:
        print(f"no GPU: {len(skipped)} checks skipped")
    elif skipped:
        print(f"{len(skipped)} checks skipped: " + "; ".join(f"{c.name} ({c.seen})" for c in skipped))
    print(f"{sum(c.status == 'pass' for c in ran)} passed, {len(failed)} failed{': ' + ', '.join(failed) if failed else ''}; "
          f"wrote {out / 'gpu_check.json'}")
    return 1 if failed else 0


def _run_check(check: Check, machine: Machine, out: Path) -> None:
    if not machine.has(check.needs):
        check.status, check.seen = "skipped", f"needs {check.needs}"
        return
    t0 = time.monotonic()
    try:
        check.seen = check.run(check, out)
        check.status = "pass"
    except Failed as e:
        check.status, check.seen = "fail", str(e)
    except Exception as e:  # a broken check is reported, and the others still run
        check.status, check.seen = "error", f"{type(e).__name__}: {e}"
    check.seconds = round(time.monotonic() - t0, 1)


def _write_json(path: Path, machine: Machine, checks: list[Check]) -> None:
    record = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": machine.facts,
              "checks": [{k: v for k, v in asdict(c).items() if k != "run"} for c in checks]}
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(record, f, indent=2)
    os.replace(f.name, path)


if __name__ == "__main__":
    sys.exit(main())
