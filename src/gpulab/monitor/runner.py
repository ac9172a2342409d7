"""The parent side of `gpulab profile`: start the script under the bootstrap, sample it, report.

The device/process sampler runs here, in the parent, so it costs the training process no GIL
time; the recorder runs in the child (it has to: it patches torch there) and streams its records
to an events file, which survives the child crashing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gpulab
from gpulab.errors import UserError
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.recorder import Recording, read_events
from gpulab.monitor.report import build_report, print_report, write_outputs
from gpulab.monitor.sampler import Sampler
from gpulab.io import check_writable

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
_USAGE = "gpulab profile [--out DIR] -- python your_script.py [args ...]"


def profile_command(command: list[str], out: Path | None, cfg: ProfileConfig) -> int:
    """Run `command` (a Python invocation) under the profiler; return the script's exit code."""
    interpreter, options, target = split_python_command(command)
    out = out or default_out_dir(target)
    check_writable(out)
    out.mkdir(parents=True, exist_ok=True)
    events = out / f".events-{os.getpid()}.jsonl"
    events.unlink(missing_ok=True)
    child = [interpreter, *options, "-m", "gpulab.monitor.bootstrap", "--events", str(events),
             "--config", json.dumps(cfg.to_dict()), "--", *target]
    proc = subprocess.Popen(child, env=child_env())
    sampler = Sampler(cfg.interval_s, pid=proc.pid).start()
    try:
        exit_code = wait_for(proc)
    finally:
        sampler.stop()
    rec = Recording(read_events(events))
    gpus = sampler.gpu.gpus
    report = build_report(rec, sampler.samples, gpus, sampler.summary(), cfg, exit_code)
    write_outputs(out, report, rec, sampler.samples, gpus, title=" ".join(target[:2]))
    events.unlink(missing_ok=True)
    print_report(report, out)
    return exit_code


def split_python_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """`python [options] (script.py | -m module | -c code) [args]` -> interpreter, options, target."""
    if not command:
        raise UserError(f"nothing to profile: give the command after --, e.g. {_USAGE}")
    interpreter = command[0]
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


def child_env() -> dict[str, str]:
    """The environment of the script, plus gpulab on PYTHONPATH (so it works without an install)."""
    env = dict(os.environ)
    root = str(Path(gpulab.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def default_out_dir(target: list[str]) -> Path:
    name = target[1] if target[0] in ("-m", "-c") else Path(target[0]).stem
    name = "code" if target[0] == "-c" else re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    return Path("profiles") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"


def wait_for(proc: subprocess.Popen) -> int:
    """The child's exit status, shell-style (128 + N when killed by signal N).

    Ctrl-C reaches the script too (same process group): it stops, and the report covers what ran.
    A second Ctrl-C kills a script that does not stop.
    """
    interrupts = 0
    while True:
        try:
            code = proc.wait()
            break
        except KeyboardInterrupt:
            interrupts += 1
            if interrupts >= 2:
                proc.kill()
    return 128 - code if code < 0 else code
