"""One process's recording, from outside the user's code.

While a session records, the hooks and patches of patches.py call the recorder; its parts do
the work, one job each:

    steps.StepAccounting    where each moment of the training thread goes; where steps end
    sites.SyncSites         the user's lines that synced or copied (CUDA)
    loaders.Loaders         the DataLoaders: where built, real batch size, which one fed the steps
    stacks.StackSampler     the hottest user line of each category
    transforms.TransformSpans   per-sample transforms inside a DataLoader fetch
    ddp.DdpWait             DDP's wait for its allreduce at the end of backward
    compiled.CompileProbe   torch.compile's compiles (their own time), recompiles, graph breaks
    memory.MemoryWindow     one step measured for memory: the peak and what it is made of
    writer.EventWriter      records out (format: monitor/events.py)
    cuda.CudaHooks          CUDA only: host syncs, copies, the kernel window

The Recorder itself is the session: it starts and stops them, gives a forked child its own
lane, and says what happens between two steps.

Only the thread that started the recorder is recorded (other threads' calls pass straight
through). A process forked from a recorded one is its own lane (its own events file) - unless it
is a DataLoader worker being started, which records nothing.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from gpulab.memory.oom import is_out_of_memory, read_out_of_memory
from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.events import EndRecord, OomRecord, ProcessRecord, RankRecord, StartRecord, events_file
from gpulab.monitor.record import patches
from gpulab.monitor.record.compiled import CompileProbe
from gpulab.monitor.record.cuda import CudaHooks
from gpulab.monitor.record.ddp import DdpWait
from gpulab.monitor.record.frames import format_site, is_user_file, user_site
from gpulab.monitor.record.heartbeat import Heartbeat, Progress
from gpulab.monitor.record.loaders import Loaders
from gpulab.monitor.record.memory import MemoryWindow
from gpulab.monitor.record.sites import SyncSites
from gpulab.monitor.record.stacks import StackSampler, hand_signal_back_on_request
from gpulab.monitor.record.steps import StepAccounting
from gpulab.monitor.record.transforms import TransformSpans
from gpulab.monitor.record.writer import EventWriter

class Recorder:
    def __init__(self, cfg: ProfileConfig, events_path: Path | None = None):
        self.cfg = cfg
        self.writer = EventWriter(events_path, self._snapshots, cfg.detail_steps)
        self.cuda = CudaHooks(self, window_after_step=cfg.warmup_steps, window_steps=cfg.kernel_window_steps)
        self.ddp = DdpWait()
        self.memory = MemoryWindow(self.writer.emit, cfg.memory_window, lambda: self.compiles.compiles > 0)
        self.error: str | None = None  # an uncaught exception (note_exception)
        self.error_where: str | None = None  # the innermost user line of its traceback
        self._ident: int | None = None
        self._stopping = False
        self._patches: patches.Patches | None = None  # in place while recording
        self.steps = StepAccounting(cfg.trace_steps, self.writer.emit, self._between_steps)
        self.transforms = TransformSpans(self.steps, cfg.warmup_steps)
        self.loaders = Loaders(self.writer.emit)
        self.compiles = CompileProbe(lambda *span: self.steps.add_closed_span(*span), self.writer.emit, self.here)
        self._new_lane_state()

    def _new_lane_state(self) -> None:
        """What each process records for itself (a forked lane starts again from here)."""
        self._pid = os.getpid()
        self.sites = SyncSites(self.cfg.warmup_steps)
        self.loaders.new_lane()
        self._optimizer_tokens: dict[int, int] = {}
        self._stacks: StackSampler | None = None
        folder = self.writer.path.parent if self.writer.path is not None else None
        self.progress = Progress(folder, self._pid)
        self._heartbeat: Heartbeat | None = None
        if self.writer.path is not None:
            self._heartbeat = Heartbeat(self.writer.path.parent, self._pid, _env_int("RANK"), lambda: self._ident,
                                        self.progress)
            self.writer.on_tick = self._heartbeat.tick

    # ------------------------------------------------------------------ session

    def start(self, command: list[str] | None = None) -> "Recorder":
        self._patches = patches.install(self)  # refuses a second recorder in this process
        self._ident = threading.get_ident()
        self._emit_start(command if command is not None else list(sys.argv))
        if self.cfg.stack_interval_s > 0:
            # the script taking SIGALRM later stops the signal sampler first (then a forked lane's)
            hand_signal_back_on_request(self._patches.patch, lambda: self._stacks)
            self._start_stack_sampler()
        return self

    def _emit_start(self, command: list[str]) -> None:
        record: StartRecord = {
            "type": "start",
            "t": time.perf_counter(),
            "pid": self._pid,
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
            "config": self.cfg.to_dict(),
        }
        self.writer.emit(record)

    def _start_stack_sampler(self) -> None:
        self._stacks = StackSampler(self.cfg.stack_interval_s, lambda: self._ident, self.steps.charged_category)
        self._stacks.start()

    def _become_forked_lane(self) -> None:
        """In a child forked from a recorded process (multiprocessing's fork/forkserver, os.fork):
        record this process from here on, in its own events file."""
        self._new_lane_state()
        self.steps = StepAccounting(self.cfg.trace_steps, self.writer.emit, self._between_steps)
        self.transforms.reset(self.steps)
        self.writer.new_lane(events_file(self.writer.path.parent, self._pid))
        self.memory = MemoryWindow(self.writer.emit, self.cfg.memory_window,  # the parent's window is the parent's
                                   lambda: self.compiles.compiles > 0)
        self._ident = threading.get_ident()  # the forking thread is the child's only thread
        argv = list(getattr(sys, "orig_argv", sys.argv))
        process: ProcessRecord = {"type": "process", "pid": self._pid, "ppid": os.getppid(), "t": time.perf_counter(),
                                  "argv": argv, "forked": True, "error": None}
        self.writer.emit(process)
        self._emit_start(argv)
        if self.cfg.stack_interval_s > 0:
            self._start_stack_sampler()

    def _detach(self) -> None:
        """In a DataLoader worker: record nothing, write nothing, leave the parent's patches inert."""
        self._ident = None
        self.writer.silenced = True

    def after_fork_in_child(self) -> None:
        """In a forked child (patches.py follows forks): a DataLoader worker or a child of an
        in-process session records nothing; any other child becomes its own lane."""
        if self._stacks is not None:
            self._stacks.forget_in_child()  # the parent's sampler: its timer or thread stayed there
        if self.writer.path is None or self.steps.loading_data():
            self._detach()
        else:
            self._become_forked_lane()

    def stop_in_any_process(self, exit_code: int | None = None, error: str | None = None) -> None:
        """stop(), if this process's recording is still running (atexit, signals, multiprocessing
        children: whichever comes first)."""
        if self.recording() and not self.writer.silenced and self._pid == os.getpid():
            self.stop(exit_code=exit_code, error=error)

    def stop(self, exit_code: int | None = None, error: str | None = None) -> None:
        """End the session: close the open step as the run's tail, restore torch, flush."""
        if not self.recording():
            return
        # A signal can arrive while stopping (SIGTERM during the atexit flush): stop only once.
        self._stopping = True
        if self._ident is not None:
            self.steps.end_step_after_backward()  # the last step of the backward rule ends with the run
        now = time.perf_counter()
        tail = self.steps.tail(now) if self._ident is not None else None
        if tail is not None:
            self.writer.emit(tail)
        if self._stacks is not None:
            self._stacks.stop()
        self.memory.finish()
        with self.cuda.suppressed():
            self.cuda.finish(self.steps.index)
        self._patches.undo()
        end: EndRecord = {"type": "end", "t": now, "exit_code": exit_code, "error": error or self.error,
                          "where": self.error_where if not error else None, "steps": self.progress.steps,
                          "cuda": self.cuda.usage()}
        self.writer.emit(end)
        self.writer.flush(final=True)
        self._ident = None
        self._patches = None

    def recording(self) -> bool:
        """Started, and not stopped (nor stopping)."""
        return self._patches is not None and not self._stopping

    def here(self) -> bool:
        """Is the caller the recorded (training) thread?"""
        return threading.get_ident() == self._ident

    @contextmanager
    def span(self, name: str, category: str):
        if not self.here():
            yield
            return
        token = self.steps.enter(name, category)
        try:
            yield
        finally:
            self.steps.exit(token)

    def mark_step(self) -> None:
        """An explicit step boundary (`p.step()`)."""
        if self.here():
            self.steps.mark_step()

    def _between_steps(self, steps_done: int) -> bool:
        """The recorder's own work after each step; whether the next one is inside a measurement
        window (kernels, memory, transforms), whose steps are left out of the statistics."""
        self.progress.step_done(steps_done)
        self.loaders.step_ended()
        if self.cuda.enabled:
            with self.cuda.suppressed():  # our own bookkeeping (kernel window) is no sync of the user's
                self.cuda.on_step_end(steps_done)
        if not self.memory.done:
            with self.cuda.suppressed():  # the memory window's synchronize and profiler are gpulab's too
                self.memory.on_step_end(steps_done, may_start=self._memory_may_start(steps_done))
        self.transforms.on_step_end(steps_done, may_open=not (self.cuda.window_active or self.memory.active))
        if self.cfg.stop_after_steps and steps_done >= self.cfg.stop_after_steps:
            self._end_process_early()
        return self.cuda.window_active or self.memory.active or self.transforms.window_active

    def _memory_may_start(self, steps_done: int) -> bool:
        """After warm-up, and after the kernel window (one torch.profiler at a time) when CUDA is in use."""
        if steps_done < self.cfg.warmup_steps:
            return False
        window = self.cuda.window
        return not window.active and (window.done or not self.cuda.enabled or not torch.cuda.is_initialized())

    def note_exception(self, error: BaseException, tb) -> None:
        """The exception that ends the script (attach.py's excepthook, or the session's block). Out
        of memory: what was in use, and where, while the failing frames still hold it."""
        self.error = f"{type(error).__name__}: {error}"
        self.error_where = _innermost_user_line(tb)
        if not (self.recording() and is_out_of_memory(error)):
            return
        try:
            oom = read_out_of_memory(error, tb, list(self.memory.models), list(self.memory.optimizers), user_site)
            record: OomRecord = {"type": "oom", **oom}
        except Exception as e:  # reading it may need memory too: say so, never hide the script's own error
            record = {"type": "oom", "message": str(error).splitlines()[0], "phase": f"unknown ({type(e).__name__})",
                      "in_use": {}, "total_in_use": 0}
        self.writer.emit(record)

    # ------------------------------------------------------------------ syncs and copies (from cuda.py)

    def add_sync(self, op: str, t0: float, t1: float, where: str | None) -> None:
        self.steps.add_closed_span(f"sync: {op}", "sync", t0, t1)
        self.steps.count("sync")
        self.sites.note("sync", op, where, self.steps.index, seconds=t1 - t0)

    def add_untimed_sync(self, where: str | None) -> None:
        """A sync torch reported (sync debug mode) inside a call gpulab does not time (e.g. x[mask])."""
        self.steps.count("sync_untimed")
        self.sites.note("sync", "untimed", where, self.steps.index, untimed=1)

    def add_h2d(self, op: str, t0: float, t1: float, nbytes: int, pinned: bool, blocking: bool,
                where: str | None) -> None:
        """A host-to-device copy. Kinds: h2d_pageable (staged through a driver buffer),
        h2d_pinned_blocking (pinned, but the host waited: no non_blocking=True), h2d_pinned (async)."""
        kind = "h2d_pageable" if not pinned else "h2d_pinned_blocking" if blocking else "h2d_pinned"
        label = "pageable" if not pinned else "pinned, blocking" if blocking else "pinned"
        self.steps.add_closed_span(f"copy: {op} ({label})", "h2d", t0, t1)
        self.steps.count(kind)
        self.steps.count(kind + "_bytes", nbytes)
        self.sites.note(kind, op, where, self.steps.index, seconds=t1 - t0, nbytes=nbytes)

    # ------------------------------------------------------------------ optimizers (from patches.py)

    def on_optimizer_pre(self, optimizer, args, kwargs) -> None:
        if self.here():
            self._optimizer_tokens[id(optimizer)] = self.steps.enter(f"{type(optimizer).__name__}.step", "compute")

    def on_optimizer_post(self, optimizer, args, kwargs) -> None:
        if not self.here():
            return
        token = self._optimizer_tokens.pop(id(optimizer), None)
        if token is not None:
            self.steps.exit(token)
        self.memory.optimizers.add(optimizer)
        self.steps.optimizer_stepped(optimizer)

    # ------------------------------------------------------------------ ranks (from patches.py)

    def note_process_group(self) -> None:
        """torch.distributed's default group is up: this process's rank, however the job was
        launched (torchrun also sets RANK; Lightning's DDP, mp.spawn and others pass the rank to
        init_process_group). The parent's hang watch asks for it too."""
        dist = torch.distributed
        record: RankRecord = {"type": "rank", "t": time.perf_counter(), "rank": dist.get_rank(),
                              "world_size": dist.get_world_size()}
        self.writer.emit(record)
        if self._heartbeat is not None:
            self._heartbeat.rank = record["rank"]

    # ------------------------------------------------------------------ output

    def _snapshots(self) -> list[dict]:
        """The whole-run tallies, written now and then and at the end (the reader keeps the last);
        also read from the writer's thread, so nothing here may call into torch's running parts."""
        steps = self.steps
        return [
            self.sites.snapshot(),
            self._stacks.snapshot() if self._stacks is not None else
            {"type": "hot", "interval_s": self.cfg.stack_interval_s, "lines": {}},
            {"type": "spans", "seconds": {k: round(v, 6) for k, v in steps.span_seconds.items()}},
            self.loaders.snapshot(),
            {"type": "facts", "step_rule": steps.rule, "backward_calls": steps.backward_calls,
             "optimizer_steps": steps.optimizer_steps, "dataloader_worker": _in_dataloader_worker(),
             "torch_threads": torch.get_num_threads(),
             "transforms": self.transforms.calls},
        ]

    @property
    def records(self) -> list[dict]:
        """Everything recorded in memory (the in-process API, which writes no file)."""
        return self.writer.records

    # ------------------------------------------------------------------ `gpulab profile --try`

    def _end_process_early(self) -> None:
        """`--try` measures the first K steps: write the record and leave at once (whatever the
        script would do next is not measured; gpulab stops what the process leaves behind)."""
        self.stop(exit_code=0)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


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


def _in_dataloader_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None
