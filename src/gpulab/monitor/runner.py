"""The parent side of `gpulab profile`: run the job with every Python process recorded, report.

The command runs as the user wrote it, with record/autostart/ first on its PYTHONPATH: every
Python process of the job (the script, its multiprocessing children, torchrun's ranks) records
itself from its own `import torch` into its own events file in a private folder
(record/attach.py). The device/process sampler runs here, in the parent, so it costs the job no
GIL time.

This process never imports torch: it would add seconds to every run for nothing.

Signals. The job runs in its own process group. SIGINT, SIGTERM and SIGHUP sent to gpulab (or to
its group: `timeout`, Slurm, Kubernetes) are passed on to the job's group once, so the script's
own handlers run; a second SIGINT escalates to SIGTERM, then SIGKILL after a grace period. When
the job's main process ends, whatever it left running in its group is stopped; if gpulab itself
is killed, the job stops itself (record/attach.py watches its parent). The report is written
from what was recorded, and the exit code is the script's (128 + N for signal N).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
import threading
import time
from pathlib import Path

import gpulab
from gpulab.errors import UserError
from gpulab.io import check_writable
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import Recording, read_lanes
from gpulab.monitor.sampler import Sampler

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
_OPTIONS_THAT_HIDE_THE_JOB = {"-I": "-I ignores PYTHONPATH", "-E": "-E ignores PYTHONPATH", "-S": "-S skips site start-up"}
_USAGE = "gpulab profile [--out DIR] -- python your_script.py [args ...]"
_AUTOSTART = Path(__file__).resolve().parent / "record" / "autostart"
_GRACE_S = 10.0  # after a second Ctrl-C: SIGTERM, then SIGKILL this much later
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def profile_command(command: list[str], out: Path | None, cfg: ProfileConfig) -> int:
    """Run `command` (a Python invocation) under the profiler; return the script's exit code."""
    interpreter, options, target = split_python_command(command)
    name = training_target(interpreter, target)
    out = out or default_out_dir(name)
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    _import_in_background("gpulab.monitor.output.report")  # matplotlib: ~0.7 s, hidden behind the job
    job = run_job([interpreter, *options, *target], cfg, out)
    from gpulab.monitor.output.report import build_job_report, print_report, write_outputs

    report, lanes = build_job_report(job.lanes, job.pid, job.samples, job.gpus, job.sampler, cfg, job.exit_code)
    write_outputs(out, report, lanes, job.samples, job.gpus, title=" ".join(name[:2]))
    print_report(report, out)
    return job.exit_code


@dataclass
class Job:
    pid: int
    exit_code: int
    lanes: list[Recording]
    samples: list[dict]
    gpus: list[dict]
    sampler: dict


def run_job(argv: list[str], cfg: ProfileConfig, out: Path) -> Job:
    """Run the job to its end with every Python process recorded; its recordings and samples."""
    events = Path(tempfile.mkdtemp(prefix=".events-", dir=out))
    try:
        with _ForwardedSignals() as signals:
            proc = subprocess.Popen(argv, env=job_env(events, cfg), process_group=0)
            signals.job = proc
            sampler = Sampler(cfg.interval_s, pid=proc.pid).start()
            try:
                exit_code = signals.wait()
            finally:
                sampler.stop()
                stop_leftovers(proc.pid)
        lanes = read_lanes(events)
    finally:
        shutil.rmtree(events, ignore_errors=True)
    return Job(proc.pid, exit_code, lanes, sampler.samples, sampler.gpu.gpus, sampler.summary())


def _import_in_background(module: str) -> None:
    threading.Thread(target=importlib.import_module, args=(module,), name="gpulab-preload", daemon=True).start()


def job_env(events: Path, cfg: ProfileConfig) -> dict[str, str]:
    """The script's environment, plus: autostart/ and gpulab on PYTHONPATH (so it works without an
    install), where to write, the settings, and who the parent is."""
    env = dict(os.environ)
    root = str(Path(gpulab.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_AUTOSTART), root, env.get("PYTHONPATH")) if p)
    env["GPULAB_PROFILE_DIR"] = str(events)
    env["GPULAB_PROFILE_CONFIG"] = json.dumps(cfg.to_dict())
    env["GPULAB_PROFILE_PARENT"] = str(os.getpid())
    return env


class _ForwardedSignals:
    """While the job runs: pass SIGINT/SIGTERM/SIGHUP on to its process group, once each; a second
    SIGINT escalates. The terminal, if any, is handed to the job so that Ctrl-C reaches it directly
    and it can read from stdin (breakpoint())."""

    def __init__(self):
        self.job: subprocess.Popen | None = None
        self._previous: dict = {}
        self._received: list[int] = []
        self._kill_at: float | None = None
        self._tty: int | None = None

    def __enter__(self) -> "_ForwardedSignals":
        for signum in _FORWARDED:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._tty is not None:
            _give_terminal_to(self._tty, os.getpgrp())
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _on_signal(self, signum, frame) -> None:
        self._received.append(signum)
        if self.job is None:
            return
        if signum == signal.SIGINT and self._received.count(signal.SIGINT) >= 2:
            _signal_group(self.job.pid, signal.SIGTERM)
            self._kill_at = self._kill_at or time.monotonic() + _GRACE_S
        elif self._received.count(signum) == 1:
            _signal_group(self.job.pid, signum)

    def wait(self) -> int:
        """The job's exit status, shell-style (128 + N when killed by signal N)."""
        self._tty = _take_terminal_for(self.job.pid)
        for signum in self._received:  # arrived before the job existed
            _signal_group(self.job.pid, signum)
        while True:
            try:
                code = self.job.wait(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if self._kill_at is not None and time.monotonic() > self._kill_at:
                    _signal_group(self.job.pid, signal.SIGKILL)
        return 128 - code if code < 0 else code


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _take_terminal_for(pgid: int) -> int | None:
    """Make the job the terminal's foreground group, as a shell would; the fd to give it back."""
    try:
        fd = sys.stdin.fileno()
        if not os.isatty(fd) or os.tcgetpgrp(fd) != os.getpgrp():
            return None
        _give_terminal_to(fd, pgid)
        return fd
    except (OSError, ValueError, AttributeError):
        return None


def _give_terminal_to(fd: int, pgid: int) -> None:
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)  # a background group may not set it
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


def stop_leftovers(pgid: int, grace_s: float = 2.0) -> None:
    """Processes the job left behind in its group (orphaned workers, children): SIGTERM, then SIGKILL."""
    _signal_group(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return
        time.sleep(0.05)
    _signal_group(pgid, signal.SIGKILL)


def split_python_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """`python [options] (script.py | -m module | -c code) [args]` -> interpreter, options, target;
    `torchrun [args]` as it is."""
    if not command:
        raise UserError(f"nothing to profile: give the command after --, e.g. {_USAGE}")
    interpreter = command[0]
    if os.path.basename(interpreter) == "torchrun":  # a Python program: every rank is recorded
        if shutil.which(interpreter) is None:
            raise UserError(f"'{interpreter}' not found: install torch in this environment, or use "
                            f"gpulab profile -- python -m torch.distributed.run ...")
        return interpreter, [], command[1:]
    named_python = _PYTHON.match(os.path.basename(interpreter))
    if not named_python and os.path.realpath(interpreter) != os.path.realpath(sys.executable):
        hint = f"gpulab profile -- python {' '.join(command)}" if interpreter.endswith(".py") else _USAGE
        raise UserError(f"gpulab profile runs Python scripts; '{interpreter}' is not a Python interpreter: use {hint}")
    if shutil.which(interpreter) is None:
        raise UserError(f"'{interpreter}' not found: give the path of a Python interpreter, e.g. {_USAGE}")
    options: list[str] = []
    i = 1
    while i < len(command):
        token = command[i]
        if token in ("-m", "-c") or token.startswith(("-m", "-c")) and not token.startswith("--"):
            flag, rest = token[:2], token[2:]
            target = [flag, rest, *command[i + 1:]] if rest else command[i:]
            if len(target) < 2:
                raise UserError(f"python {flag} needs a {'module' if flag == '-m' else 'program'}: {_USAGE}")
            return interpreter, options, target
        if token == "-":
            raise UserError(f"a script read from stdin cannot be profiled: save it to a file, {_USAGE}")
        if token in _OPTIONS_THAT_HIDE_THE_JOB:
            raise UserError(f"python {token} cannot be profiled ({_OPTIONS_THAT_HIDE_THE_JOB[token]}, which gpulab "
                            f"uses to record the script): drop {token}")
        if token in _OPTIONS_WITH_VALUE:
            options += command[i:i + 2]
            i += 2
        elif token.startswith("-"):
            options.append(token)
            i += 1
        else:
            script = Path(token)
            if not script.is_file():
                raise UserError(f"script {token} not found: check the path (relative to {Path.cwd()})")
            return interpreter, options, command[i:]
    raise UserError(f"no script given: {_USAGE}")


def training_target(interpreter: str, target: list[str]) -> list[str]:
    """What the job runs, for its name: under torchrun (`torchrun ...` or `-m torch.distributed.run
    ...`) the script or module after the launcher's own options, else the target itself."""
    if os.path.basename(interpreter) == "torchrun":
        launcher_args = target
    elif target[:2] == ["-m", "torch.distributed.run"]:
        launcher_args = target[2:]
    else:
        return target
    for i, token in enumerate(launcher_args):
        if token in ("-m", "--module") and i + 1 < len(launcher_args):
            return ["-m", *launcher_args[i + 1:]]
        if not token.startswith("-") and (token.endswith(".py") or i > 0 and launcher_args[i - 1] == "--"):
            return launcher_args[i:]
    return target


def default_out_dir(target: list[str]) -> Path:
    name = target[1] if target[0] in ("-m", "-c") else Path(target[0]).stem
    name = "code" if target[0] == "-c" else re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return Path("profiles") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
