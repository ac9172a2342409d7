"""One process's recording, from outside the user's code: the list of probes plus the sink.

Each recorded concern is a probe (probes/): it installs its own hooks and patches, writes only
through the sink (span, count, emit, the step rules; sink.py), learns what other probes see only
from notices (notices.py), and takes its hooks out again. Around them the Recorder is the session:

    steps.StepAccounting    where each moment of the training thread goes; where steps end
    sink.Sink               what the probes write through (the step accounting, the writer, notices)
    windows.MeasurementWindows   the probes that measure in a window of steps, taking turns
    writer.EventWriter      records out (format: monitor/events.py)
    alive.child.Heartbeat   progress for the parent's hang watch (progress, rank_known notices)

It starts and stops the probes, gives a forked child its own lane (forked), ends a
multiprocessing child's recording (process_ending), and says what happens between two steps.

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
from gpulab.monitor.record.probe import Probe, WindowProbe
from gpulab.monitor.record.probes.autograd import AutogradProbe
from gpulab.monitor.record.probes.compiled import CompileProbe
from gpulab.monitor.record.probes.cuda import CudaSyncProbe
from gpulab.monitor.record.probes.distributed import DistributedProbe
from gpulab.monitor.record.probes.kernels import KernelProbe
from gpulab.monitor.record.probes.loaders import LoaderProbe
from gpulab.monitor.record.probes.memory_window import MemoryProbe
from gpulab.monitor.record.probes.modules import ModuleProbe
from gpulab.monitor.record.probes.trainer import TrainerPhasesProbe
from gpulab.monitor.record.probes.processes import ProcessProbe
from gpulab.monitor.record.probes.stacks import StackProbe
from gpulab.monitor.record.probes.transforms import TransformProbe
from gpulab.monitor.record.sink import Sink
from gpulab.monitor.record.steps import StepAccounting
from gpulab.monitor.record.windows import MeasurementWindows
from gpulab.monitor.record.writer import EventWriter


def make_probes(cfg: ProfileConfig) -> list[Probe]:
    """Every probe, in the order they are installed (and removed in reverse). The modules probe
    comes after the loaders probe (its pause in fetches goes around their fetch spans) and before
    the transforms probe (which tells it, at install, that the warm-up wants the modules called
    in fetches); the windows take their turns in this order: kernels, memory, transforms."""
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
        StackProbe(cfg.stack_interval_s),
    ]


class Recorder:
    def __init__(self, cfg: ProfileConfig, events_path: Path | None = None):
        self.cfg = cfg
        self.writer = EventWriter(events_path, self._snapshots, cfg.detail_steps)
        self._steps = StepAccounting(cfg.trace_steps, self.writer.emit, self._between_steps)
        self.sink = Sink(self._steps, self.writer.emit, Notices())
        self.probes = make_probes(cfg)
        self._windows = MeasurementWindows([p for p in self.probes if isinstance(p, WindowProbe)])
        self.error: str | None = None  # an uncaught exception (note_exception)
        self.error_where: str | None = None  # the innermost user line of its traceback
        self._recording = False
        self._stopping = False
        self.sink.notices.exception.listen(self._note_error)
        self.sink.notices.forked.listen(self._after_fork_in_child)
        self.sink.notices.process_ending.listen(self.stop_in_any_process)
        self.sink.notices.rank_known.listen(self._rank_known)
        self._stop_listening_to_progress = None
        self._new_lane_state()

    def _new_lane_state(self) -> None:
        """What each process keeps for the parent's hang watch (a forked lane starts again from here)."""
        self._pid = os.getpid()
        folder = self.writer.path.parent if self.writer.path is not None else None
        self._progress = Progress(folder, self._pid)
        if self._stop_listening_to_progress is not None:
            self._stop_listening_to_progress()
        self._stop_listening_to_progress = self.sink.notices.progress.listen(self._progress.made)
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
        """stop(), if this process's recording is still running (atexit, signals, multiprocessing
        children: whichever comes first)."""
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
        """The exception that ends the script (attach.py's excepthook, or the session's block): the
        recorder keeps it for the end record; the probes hear of it (out of memory: the memory
        probe says what was in use, and where, while the failing frames still hold it)."""
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
        """The recorder's own work after each step; whether the next one is inside a measurement
        window (kernels, memory, transforms), whose steps are left out of the statistics."""
        self._progress.step_done(steps_done)
        self.sink.notices.step_ended.send(steps_done)
        profiled = False
        if self._windows.pending():
            with self.sink.own_work():  # the windows' synchronize and profilers are gpulab's, not the user's
                profiled = self._windows.on_step_end(steps_done)
        if self.cfg.stop_after_steps and steps_done >= self.cfg.stop_after_steps:
            self._end_process_early()
        return profiled

    def _end_process_early(self) -> None:
        """`--try` measures the first K steps: write the record and leave at once (whatever the
        script would do next is not measured; gpulab stops what the process leaves behind)."""
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
            self._detach()
        else:
            self._become_forked_lane()

    def _detach(self) -> None:
        """In a DataLoader worker: record nothing, write nothing, leave the parent's patches inert."""
        self.sink.ident = None
        self.writer.silenced = True

    def _become_forked_lane(self) -> None:
        """In a child forked from a recorded process (multiprocessing's fork/forkserver, os.fork):
        record this process from here on, in its own events file."""
        self._new_lane_state()
        self._steps.new_lane()
        self.writer.new_lane(events_file(self.writer.path.parent, self._pid))
        self.sink.ident = threading.get_ident()  # the forking thread is the child's only thread
        for probe in self.probes:
            probe.new_lane()
        argv = list(getattr(sys, "orig_argv", sys.argv))
        process: ProcessRecord = {"type": "process", "pid": self._pid, "ppid": os.getppid(), "t": time.perf_counter(),
                                  "argv": argv, "forked": True, "error": None}
        self.writer.emit(process)
        self.writer.emit(start_record(self.cfg, self._pid, argv))

    # ------------------------------------------------------------------ output

    def _snapshots(self) -> list[dict]:
        """The whole-run tallies, written now and then and at the end (the reader keeps the last);
        also read from the writer's thread, so nothing here may call into torch's running parts."""
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
