"""The Python API: profile a training loop in this process, a job of one lane.

    with gpulab.monitor.profile(out="prof") as p:
        for X, y in loader:
            ...
            optimizer.step()      # steps are found from optimizer.step() ...
            p.step()              # ... or marked explicitly (then only p.step() counts)

On leaving the block the report is written to `out` and printed (stderr), and `p.report` holds
it; an exception inside the block still writes a partial report, then propagates. Files in `out`
that gpulab did not write are refused on entering the block (unless force=True). Under `gpulab
profile`, which records the whole process already, the block records nothing of its own: its
p.step() marks go to that recording.
"""

from __future__ import annotations

import sys
from pathlib import Path

from rich.console import Console

from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import Recording
from gpulab.monitor.output import OUTPUTS
from gpulab.monitor.parent.runner import JobRun, report_job
from gpulab.monitor.parent.sampler import Sampler
from gpulab.monitor.record.attach import recorder_of_gpulab_profile
from gpulab.monitor.record.recorder import Recorder
from gpulab.errors import UserError
from gpulab.io import OutputFolder, check_writable, given_path


class Profile:
    """`settings` are ProfileConfig fields; `force`: replace files in `out` that gpulab did not write;
    `real_folder`: `out` is a folder gpulab picked inside one the user named (gpulab train --profile's
    RUN_DIR/profile), never a link, with no force to offer."""

    def __init__(self, out: str | Path = "profile", *, console: Console | None = None, quiet: bool = False,
                 force: bool = False, real_folder: bool = False, **settings):
        self.cfg = ProfileConfig(**settings)
        self.out = given_path(out, option="out")
        if real_folder:
            self.outputs = OutputFolder(self.out, str(self.out), fix="move it out of the folder", force_hint=None,
                                        real_folder=True)
        else:
            self.outputs = OutputFolder(self.out, f"out {self.out}", force=force, force_hint="pass force=True")
        self.console = console
        self.quiet = quiet
        self.report: dict | None = None
        self._sampler: Sampler | None = None
        self._recorder: Recorder | None = None
        self._outer = False  # gpulab profile's recorder, not this session's

    def __enter__(self) -> "Profile":
        self._recorder = recorder_of_gpulab_profile()
        if self._recorder is not None:
            self._outer = True
            if not self.quiet:
                print(f"gpulab profile records this whole process: its report is the one, {self.out} is not written",
                      file=sys.stderr, flush=True)
            return self
        check_writable(self.out, option="out")
        self.outputs.check(OUTPUTS)
        self._sampler = Sampler(self.cfg.interval_s).start()
        try:
            self._recorder = Recorder(self.cfg).start(command=list(sys.argv))
        except BaseException:
            self._sampler.stop()
            raise
        return self

    def step(self) -> None:
        """Mark the end of a training step."""
        if self._recorder is None:
            raise UserError("p.step() marks a step inside the block: with gpulab.monitor.profile(...) as p: ... p.step()")
        self._recorder.mark_step()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._outer:
            return False
        exit_code, error = _ending(exc)
        if error is not None:
            self._recorder.note_exception(exc, tb)
        self._recorder.stop(exit_code=exit_code, error=error)
        self._sampler.stop()
        rec = Recording(self._recorder.records)
        job = JobRun(rec.pid, exit_code, [rec], self._sampler)
        self.report, unwritten = report_job(job, self.cfg, self.outputs, _program_name(), self.console, self.quiet)
        if unwritten is not None and exc_type is None:
            raise unwritten
        if unwritten is not None:  # the block's own exception is the one that matters
            print(f"gpulab profile: {unwritten}", file=sys.stderr, flush=True)
        return False  # never swallow the exception


def _ending(exc: BaseException | None) -> tuple[int, str | None]:
    """(exit code, error) of a process the block's exception would end, as Python ends it:
    sys.exit(0) or sys.exit() succeed, sys.exit(n) exits n, sys.exit("why") 1; Ctrl-C 130."""
    if exc is None:
        return 0, None
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None or code == 0:
            return 0, None
        return (code & 0xFF if isinstance(code, int) else 1), f"SystemExit: {code}"
    error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return (130 if isinstance(exc, KeyboardInterrupt) else 1), error


def _program_name() -> str:
    """"train.py", or "gpulab train" for `python -m gpulab train`, for the timeline's title."""
    script = Path(sys.argv[0]) if sys.argv and sys.argv[0] else None
    if script is None or script.name in ("-c", ""):
        return "python"
    if script.name == "__main__.py":
        return " ".join([script.parent.name, *sys.argv[1:2]])
    return script.name

