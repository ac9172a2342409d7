"""One process's recording: the probes (probes/, each a recorded concern) around one sink.

Only the thread that started the recorder is recorded (other threads' calls pass straight
through). A process forked from a recorded one is its own lane (its own events file) - unless it
is a DataLoader worker being started, which records nothing. A second recorder in the same
process is refused: the patches are the shared resource, so that is what start() checks.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

import torch

from gpulab.errors import UserError
from gpulab.monitor.alive.child import Heartbeat, Progress
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import EndRecord, ProcessRecord, StartRecord, events_file
from gpulab.monitor.record import patches
from gpulab.monitor.record.frames import format_site, is_user_file
from gpulab.monitor.record.notices import Notices
from gpulab.monitor.record.probe import Probe, WindowProbe, take_turns
from gpulab.monitor.record.probes.autograd import AutogradProbe
from gpulab.monitor.record.probes.compiled import CompileProbe
from gpulab.monitor.record.probes.cuda import CudaSyncProbe
from gpulab.monitor.record.probes.distributed import DistributedProbe
from gpulab.monitor.record.probes.kernels import KernelProbe
from gpulab.monitor.record.probes.loaders import LoaderProbe
from gpulab.monitor.record.probes.memory_window import MemoryProbe
from gpulab.monitor.record.probes.modules import ModuleProbe
from gpulab.monitor.record.probes.ops import OpsProbe
from gpulab.monitor.record.probes.trainer import TrainerPhasesProbe
from gpulab.monitor.record.probes.processes import ProcessProbe
from gpulab.monitor.record.probes.stacks import StackProbe
from gpulab.monitor.record.probes.transforms import TransformProbe
from gpulab.monitor.record.sink import Sink
from gpulab.monitor.record.steps import StepAccounting
from gpulab.monitor.record.writer import EventWriter


def make_probes(cfg: ProfileConfig) -> list[Probe]:
    """Every probe, in the order they are installed (removed in reverse) and the windows take
    their turns. The modules probe comes after the loaders probe (its pause in fetches goes around
    their fetch spans) and before the transforms probe (which asks it, at install, for the modules
    called in fetches)."""
    return [
        LoaderProbe(cfg.dataloader_overrides),
        ModuleProbe(),
        AutogradProbe(),
        DistributedProbe(),
        ProcessProbe(cfg.torch_threads),
        TrainerPhasesProbe(),
        CompileProbe(),
        CudaSyncProbe(cfg.warmup_steps),
        KernelProbe(cfg.warmup_steps, cfg.kernel_window_steps),
        MemoryProbe(cfg.memory_window, cfg.warmup_steps),
        TransformProbe(cfg.warmup_steps),
        OpsProbe(cfg.operators_window, cfg.warmup_steps),
        StackProbe(cfg.stack_interval_s),
    ]


class Recorder:
    def __init__(self, cfg: ProfileConfig, events_path: Path | None = None):
        self.cfg = cfg
        self.writer = EventWriter(events_path, self._snapshots, cfg.detail_steps)
        self._steps = StepAccounting(cfg.trace_steps, self.writer.emit, self._between_steps)
        self.sink = Sink(self._steps, self.writer.emit, Notices())
        self.probes = make_probes(cfg)
        self._windows = [p for p in self.probes if isinstance(p, WindowProbe)]
        self.error: str | None = None  # an uncaught exception (note_exception)
        self.error_where: str | None = None  # the innermost user line of its traceback
        self._recording = False
        self._stopping = False
        self.sink.notices.exception.listen(self._note_error)
        self.sink.notices.forked.listen(self._after_fork_in_child)
        self.sink.notices.process_ending.listen(self.stop_in_any_process)
        self.sink.notices.rank_known.listen(self._rank_known)
        self.sink.notices.progress.listen(lambda: self._progress.made())  # this lane's
        self._new_lane_state()

    def _new_lane_state(self) -> None:
        """What each process keeps for the parent's hang watch (a forked lane starts again here)."""
        self._pid = os.getpid()
        folder = self.writer.path.parent if self.writer.path is not None else None
        self._progress = Progress(folder, self._pid)
        self._heartbeat: Heartbeat | None = None
        if folder is not None:
            self._heartbeat = Heartbeat(folder, self._pid, _env_int("RANK"), lambda: self.sink.ident, self._progress)
            self.writer.on_tick = self._heartbeat.tick

    # ------------------------------------------------------------------ session

    def start(self, command: list[str] | None = None) -> "Recorder":
        if patches.installed():
            raise UserError("a gpulab profile is already running in this process: end it before starting another")
        self.sink.ident = threading.get_ident()
        for probe in self.probes:
            probe.install(self.sink)
        self._recording = True
        self.writer.emit(start_record(self.cfg, self._pid, command if command is not None else list(sys.argv)))
        return self

    def stop(self, exit_code: int | None = None, error: str | None = None) -> None:
        """End the session: close the open step as the run's tail, take the probes out, flush."""
        if not self.recording():
            return
        # A signal can arrive while stopping (SIGTERM during the atexit flush): stop only once.
        self._stopping = True
        if self.sink.ident is not None:
            self._steps.end_step_after_backward()  # the last step of the backward rule ends with the run
        now = time.perf_counter()
        tail = self._steps.tail(now) if self.sink.ident is not None else None
        if tail is not None:
            self.writer.emit(tail)
        with self.sink.own_work():  # a window's closing synchronize is no sync of the user's
            for probe in self.probes:
                probe.finish()
        for probe in reversed(self.probes):
            probe.remove()
        end: EndRecord = {"type": "end", "t": now, "exit_code": exit_code, "error": error or self.error,
                          "where": self.error_where if not error else None, "steps": self._progress.steps}
        for probe in self.probes:
            end.update(probe.end_fields())
        self.writer.emit(end)
        self.writer.close()
        self.sink.ident = None
        self._recording = False

    def stop_in_any_process(self, exit_code: int | None = None, error: str | None = None) -> None:
        """stop(), if this process's recording still runs (atexit, a signal, a multiprocessing child's end)."""
        if self.recording() and not self.writer.silenced and self._pid == os.getpid():
            self.stop(exit_code=exit_code, error=error)

    def recording(self) -> bool:
        """Started, and not stopped (nor stopping)."""
        return self._recording and not self._stopping

    def mark_step(self) -> None:
        """An explicit step boundary (`p.step()`)."""
        if self.sink.here():
            self._steps.mark_step()

    def note_exception(self, error: BaseException, tb) -> None:
        """The exception that ends the script (lifetime.py's excepthook, or the session's block),
        for the end record and the probes (the memory probe reads an out-of-memory error's frames)."""
        self.sink.notices.exception.send(error, tb)

    def _note_error(self, error: BaseException, tb) -> None:
        self.error = f"{type(error).__name__}: {error}"
        self.error_where = _innermost_user_line(tb)

    def _rank_known(self, rank: int) -> None:
        if self._heartbeat is not None:
            self._heartbeat.rank = rank

    @property
    def records(self) -> list[dict]:
        """Everything recorded in memory (the in-process API, which writes no file)."""
        return self.writer.records

    # ------------------------------------------------------------------ between steps

    def _between_steps(self, steps_done: int) -> bool:
        """The recorder's own work after each step; whether the next one is inside a measurement window."""
        self._progress.step_done(steps_done)
        self.sink.notices.step_ended.send(steps_done)
        profiled = False
        if not all(window.finished for window in self._windows):  # most of a run: all are
            with self.sink.own_work():  # the windows' synchronize and profilers are gpulab's, not the user's
                profiled = take_turns(self._windows, steps_done)
        if self.cfg.stop_after_steps and steps_done >= self.cfg.stop_after_steps:
            self._end_process_early()
        return profiled

    def _end_process_early(self) -> None:
        """`--try` measures the first K steps: write the record and leave at once (gpulab stops
        what the process leaves behind)."""
        self.stop(exit_code=0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    # ------------------------------------------------------------------ forked children

    def _after_fork_in_child(self) -> None:
        """In a forked child: a DataLoader worker or a child of an in-process session records
        nothing; any other child becomes its own lane."""
        if not self.recording():
            return
        for probe in self.probes:
            probe.after_fork()  # what stayed in the parent: the stack sampler's timer or thread
        if self.writer.path is None or self._steps.loading_data():
            self.sink.ident = None  # the parent's patches stay, inert
            self.writer.silenced = True
            return
        self._new_lane_state()
        self._steps.new_lane()
        self.writer.new_lane(events_file(self.writer.path.parent, self._pid))
        self.sink.new_lane(threading.get_ident())
        for probe in self.probes:
            probe.new_lane()
        argv = list(getattr(sys, "orig_argv", sys.argv))
        process: ProcessRecord = {"type": "process", "pid": self._pid, "ppid": os.getppid(), "t": time.perf_counter(),
                                  "argv": argv, "forked": True, "error": None}
        self.writer.emit(process)
        self.writer.emit(start_record(self.cfg, self._pid, argv))

    # ------------------------------------------------------------------ output

    def _snapshots(self) -> list[dict]:
        """The whole-run tallies (the reader keeps the last); also read from the writer's thread."""
        steps = self._steps
        facts = {"type": "facts", "step_rule": steps.rule, "backward_calls": steps.backward_calls,
                 "optimizer_steps": steps.optimizer_steps}
        for probe in self.probes:
            facts.update(probe.facts())
        return [*(record for probe in self.probes for record in probe.snapshots()),
                {"type": "spans", "seconds": {k: round(v, 6) for k, v in steps.span_seconds.items()}}, facts]


def start_record(cfg: ProfileConfig, pid: int, command: list[str]) -> StartRecord:
    return {
        "type": "start",
        "t": time.perf_counter(),
        "pid": pid,
        "ppid": os.getppid(),
        "rank": _env_int("RANK"),
        "local_world_size": _env_int("LOCAL_WORLD_SIZE"),  # ranks sharing this machine's cores
        "world_size": _env_int("WORLD_SIZE"),
        "command": command,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda_build": torch.version.cuda,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "config": cfg.to_dict(),
    }


def _innermost_user_line(tb) -> str | None:
    """The user's line where an exception was raised (or called into torch that raised it)."""
    where = None
    while tb is not None:
        if is_user_file(tb.tb_frame.f_code.co_filename):
            where = format_site(tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return where


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else None
