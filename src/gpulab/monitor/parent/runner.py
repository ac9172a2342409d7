"""The parent side of `gpulab profile`: run the job with every Python process recorded, report.

The command runs as the user wrote it, with record/autostart/ first on its PYTHONPATH: every
Python process of the job (the script, its multiprocessing children, torchrun's ranks) records
itself from its own `import torch` into its own events file in a private folder
(record/attach.py). The sampler runs here, so it costs the job no GIL time; and this process
never imports torch, which would add seconds to every run for nothing. The exit code is the
script's (128 + N for signal N).
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import re
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

import gpulab
from gpulab.errors import UserError
from gpulab.io import CannotWrite, OutputFolder, OutputRefused, check_writable, writing_results
from gpulab.monitor.alive.watch import HangWatch
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import Recording, read_lanes
from gpulab.monitor.output import OUTPUTS
from gpulab.monitor.parent.job import Job
from gpulab.monitor.parent.sampler import Sampler

_PYTHON = re.compile(r"^python(\d+(\.\d+)*)?(\.exe)?$")
_OPTIONS_WITH_VALUE = ("-X", "-W", "--check-hash-based-pycs")
_OPTIONS_THAT_HIDE_THE_JOB = {"-I": "-I ignores PYTHONPATH", "-E": "-E ignores PYTHONPATH", "-S": "-S skips site start-up"}
_USAGE = "gpulab profile [--out DIR] -- python your_script.py [args ...]"
FLIGHT_RECORDER_ENTRIES = 2000
_AUTOSTART = Path(__file__).resolve().parent.parent / "record" / "autostart"


def profile_command(command: list[str], out: Path | None, cfg: ProfileConfig, force: bool = False) -> int:
    """Run `command` (a Python invocation) under the profiler; return the script's exit code.
    `force`: replace files in `out` that gpulab did not write."""
    with job_folder(command, out, force, OUTPUTS) as (argv, name, outputs):
        threading.Thread(target=importlib.import_module, args=("gpulab.monitor.output.report",),  # matplotlib:
                         name="gpulab-preload", daemon=True).start()  # ~0.7 s, hidden behind the job
        job = run_job(argv, cfg, outputs.path)
    _, unwritten = report_job(job, cfg, outputs, " ".join(name[:2]))
    if unwritten is not None:  # the job ran: its exit code is still the answer
        print(f"gpulab profile: {unwritten}", file=sys.stderr, flush=True)
    return job.exit_code


@contextmanager
def job_folder(command: list[str], out: Path | None, force: bool, files) -> Iterator[tuple[list, list, OutputFolder]]:
    """The job's argv and name, and its output folder (default: named after it), where `files` are
    checked before the job runs - its results would have nowhere to go - and which is made here and
    removed again if the work inside fails and leaves it empty."""
    interpreter, options, target = split_python_command(command)
    name = training_target(interpreter, target)
    outputs = OutputFolder.out(out or default_out_dir(name), force)
    check_writable(outputs.path)
    outputs.check(files)
    with removed_if_left_empty(outputs.path, new=out is None):
        yield [interpreter, *options, *target], name, outputs


@dataclass
class JobRun:
    """A job run to its end: an in-process session is one of one lane."""

    pid: int
    exit_code: int
    lanes: list[Recording]
    sampler: Sampler  # stopped
    hang: dict | None = None  # alive/watch.py: where each process was blocked, when the job hung
    stalls: list[dict] = field(default_factory=list)  # alive/watch.py: where each was while the job stood still
    stopped: bool = False  # gpulab stopped the job (the hang, or a signal to gpulab)
    suspended: list[tuple[float, float]] = field(default_factory=list)  # stopped at the terminal (Ctrl-Z), until


def report_job(job: JobRun, cfg: ProfileConfig, outputs: OutputFolder, title: str, console: Console | None = None,
               quiet: bool = False) -> tuple[dict, UserError | None]:
    """The job's report, built, written (each file whole or absent) and printed unless `quiet`; and
    why its files could not be written (a full disk, a user's file put there meanwhile), if so."""
    from gpulab.monitor.output.report import build_report, print_report, write_outputs  # behind the job

    samples, gpus = job.sampler.samples, job.sampler.gpu.gpus
    report, lanes = build_report(job.lanes, job.pid, samples, gpus, job.sampler.summary(), cfg, job.exit_code,
                                 hang=job.hang, stalls=job.stalls, stopped=job.stopped, suspended=job.suspended)
    try:
        write_outputs(outputs, report, lanes, samples, gpus, title=title)
    except (OSError, OutputRefused) as e:
        return report, CannotWrite(e) if isinstance(e, OSError) else e
    if not quiet:
        print_report(report, outputs.path, console)
    return report, None


def run_job(argv: list[str], cfg: ProfileConfig, out: Path) -> JobRun:
    """Run the job to its end with every Python process recorded (stopping it: parent/job.py)."""
    with writing_results():
        # absolute: the job's processes find it from wherever they are (a script may chdir, a
        # child start elsewhere); not resolved, so a link on the way is the one --out named
        events = Path(os.path.abspath(tempfile.mkdtemp(prefix=".events-", dir=out)))
    try:
        with Job() as job:
            try:
                proc = job.start(argv, job_env(events, cfg))
            except OSError as e:  # a file named like an interpreter that is not one, no permission
                raise UserError(f"could not start {argv[0]} ({e.strerror or e}): give the path of a Python "
                                f"interpreter, e.g. {_USAGE}") from None
            sampler = Sampler(cfg.interval_s, pid=proc.pid).start()
            hangs = HangWatch(events, cfg)

            def watch() -> None:
                if hangs.poll() is not None and cfg.on_hang == "stop":
                    job.stop()

            try:
                exit_code = job.wait(on_tick=watch, on_resume=hangs.resumed)
            finally:
                sampler.stop()
                hangs.finish()
        lanes = read_lanes(events)
    finally:
        shutil.rmtree(events, ignore_errors=True)
    return JobRun(proc.pid, exit_code, lanes, sampler, hangs.hang, hangs.stalls, job.stopping, job.suspended)


@contextmanager
def removed_if_left_empty(out: Path, new: bool = False) -> Iterator[None]:
    """The output folder, made here with its missing parents; the ones still empty go again if the
    work inside fails (a refusal leaves nothing behind). `new`: gpulab's default, which must not
    exist yet (another job may just have taken it)."""
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # the deepest first
    try:
        with writing_results():
            out.mkdir(parents=True, exist_ok=not new)
    except FileExistsError:
        raise UserError(f"{out}: another job took this folder a moment ago; run again, or name one with --out") from None
    try:
        yield
    except BaseException:
        for folder in made:
            try:
                folder.rmdir()
            except OSError:  # not empty: kept, and the folders above it
                break
        raise


def job_env(events: Path, cfg: ProfileConfig) -> dict[str, str]:
    """The script's environment, plus: autostart/ and gpulab on PYTHONPATH (so it works without an
    install), where to write, the settings, and who the parent is."""
    env = dict(os.environ)
    root = str(Path(gpulab.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_AUTOSTART), root, env.get("PYTHONPATH")) if p)
    env["GPULAB_PROFILE_DIR"] = str(events)
    env["GPULAB_PROFILE_CONFIG"] = json.dumps(cfg.to_dict())
    env["GPULAB_PROFILE_PARENT"] = str(os.getpid())
    if cfg.torch_threads:  # torch (and OpenMP, MKL) size their thread pools from these at start
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(cfg.torch_threads)
    # torch's flight recorder: the last collectives of each process, for the hang watch
    env.setdefault("TORCH_FR_BUFFER_SIZE", str(FLIGHT_RECORDER_ENTRIES))
    return env


def split_python_command(command: list[str]) -> tuple[str, list[str], list[str]]:
    """`python [options] (script.py | -m module | -c code) [args]` -> interpreter, options, target;
    `torchrun [args]` as it is. The script, also the one a launcher would start, must exist: else
    every rank would start, fail at once, and leave a report of nothing."""
    if not command:
        raise UserError(f"nothing to profile: give the command after --, e.g. {_USAGE}")
    interpreter = command[0]
    if os.path.basename(interpreter) == "torchrun":  # a Python program: every rank is recorded
        if shutil.which(interpreter) is None:
            raise UserError(f"'{interpreter}' not found: install torch in this environment, or use "
                            f"gpulab profile -- python -m torch.distributed.run ...")
        return interpreter, [], _checked_launch(interpreter, command[1:])
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
            return interpreter, options, _checked_launch(interpreter, target)
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
            _check_script(token)
            return interpreter, options, command[i:]
    raise UserError(f"no script given: {_USAGE}")


def _check_script(path: str) -> None:
    """What Python runs as a script: a file (a zip application too), or a folder with __main__.py."""
    script = Path(path)
    if script.is_dir() and not (script / "__main__.py").is_file():
        raise UserError(f"{path} is a folder without __main__.py: name the script in it to run")
    if not (script.is_file() or script.is_dir()):
        raise UserError(f"script {path} not found: check the path (relative to {Path.cwd()})")


def _checked_launch(interpreter: str, target: list[str]) -> list[str]:
    """`target`, once the script torchrun would start is found to exist (a module, or a program
    that may be on PATH, is not checked)."""
    launcher_args = _launcher_args(interpreter, target) or []
    for i, token in enumerate(launcher_args):
        if token in ("-m", "--module", "--no-python", "--no_python"):
            break
        if _is_launched_script(launcher_args, i):
            _check_script(token)
            break
    return target


def _launcher_args(interpreter: str, target: list[str]) -> list[str] | None:
    """The arguments of torchrun (`torchrun ...` or `-m torch.distributed.run ...`); None without it."""
    if os.path.basename(interpreter) == "torchrun":
        return target
    return target[2:] if target[:2] == ["-m", "torch.distributed.run"] else None


def training_target(interpreter: str, target: list[str]) -> list[str]:
    """What the job runs, for its name: under torchrun the script or module after the launcher's
    own options, else the target itself."""
    launcher_args = _launcher_args(interpreter, target)
    for i, token in enumerate(launcher_args or []):
        if token in ("-m", "--module") and i + 1 < len(launcher_args):
            return ["-m", *launcher_args[i + 1:]]
        if _is_launched_script(launcher_args, i):
            return launcher_args[i:]
    return target


def _is_launched_script(launcher_args: list[str], i: int) -> bool:
    """Whether torchrun's argument i is the script it starts: the first .py file, or what follows --."""
    token = launcher_args[i]
    return not token.startswith("-") and (token.endswith(".py") or i > 0 and launcher_args[i - 1] == "--")


def default_out_dir(target: list[str]) -> Path:
    """profiles/<time>-<script>, with -2, -3, ... after it when a job started in the same second
    has that name (removed_if_left_empty(..., new=True) then makes it this job's)."""
    name = target[1] if target[0] in ("-m", "-c") else Path(target[0]).stem
    name = "code" if target[0] == "-c" else re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    base = Path("profiles") / f"{time.strftime('%Y%m%d-%H%M%S')}-{name}"
    candidates = (base.with_name(f"{base.name}-{n}") if n > 1 else base for n in itertools.count(1))
    return next(path for path in candidates if not os.path.lexists(path))
