"""This process's place in a training job, and the rules that keep a multi-process job honest.

`World` is one process: rank 0 of 1, every method trivial. `TorchrunWorld` is one rank of a job
launched by torchrun (or anything that sets torchrun's environment: RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). It uses torch.distributed for every
byte it moves; gpulab adds only the rules:

- Rank 0 is the main process: it alone prints and writes. What it decides (the run directory,
  a resumed run's config and checkpoint) is shared with the others (`share`, `broadcast`).
- An error on one rank during set-up stops every rank at once (`all_or_none`), instead of
  leaving the others waiting in a collective.
- Start-up collectives may wait long (STARTUP_TIMEOUT: slow nodes, data being unpacked);
  training collectives run on their own group with a short timeout (`--timeout`), so a dead or
  hung rank turns into an error on the others within that time, never a hang.
- When a collective fails, the survivor raises a flag in the rendezvous store and every live
  rank checks in, answered by a small watchdog thread so that a rank blocked inside a collective
  still counts as alive; whoever does not check in is the rank that failed, and the message
  names it (`failure`).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import torch

from gpulab.errors import UserError

T = TypeVar("T")
STARTUP_TIMEOUT = timedelta(minutes=10)
CHECK_IN_S = 2.0  # how long survivors of a failure wait for each other in the store
WATCHDOG_POLL_S = 0.5  # how often each rank's watchdog looks for a failure flag


class SharedError(UserError):
    """An error every rank raises together; the rank that printed it is named in `printed_by`.
    The CLI prints it on that rank only, so a job of K ranks says it once."""

    def __init__(self, message: str, printed_by: int = 0):
        super().__init__(message)
        self.printed_by = printed_by


class PeerLost(RuntimeError):
    """A collective failed because another rank died, hung past the timeout or crashed."""


class Terminated(BaseException):
    """SIGTERM (from torchrun after another rank failed, or from a scheduler): stop cleanly."""


class JobFailed(Exception):
    """This rank stopped because of another rank's failure; the message says which and where."""

    def __init__(self, message: str, quiet: bool):
        super().__init__(message)
        self.quiet = quiet  # another surviving rank prints the same line


class World:
    """One process: rank 0 of 1."""

    rank = 0
    world_size = 1
    local_rank = 0
    local_world_size = 1
    group = None  # the process group of training collectives (None: the default)
    backend = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def connect(self, device: torch.device, backend: str = "auto", timeout_s: float = 60.0) -> None:
        pass

    def share(self, key: str, compute: Callable[[], T]) -> T:
        """`compute()` on the main process; every process gets its result (or its UserError)."""
        return compute()

    def all_or_none(self, fn: Callable[[], T]) -> T:
        """`fn()` on every process; if it raises a UserError on any, every process raises."""
        return fn()

    def local_main_first(self, fn: Callable[[], T]) -> T:
        """`fn()` on local rank 0 of each machine first (it may download or unpack files), then on
        the other ranks, which find them in place."""
        return fn()

    def broadcast(self, obj: T) -> T:
        """The main process's `obj` on every process."""
        return obj

    def gather(self, obj: T) -> list[T] | None:
        """Every process's `obj`, in rank order, on the main process (None elsewhere)."""
        return [obj]

    def barrier(self) -> None:
        pass

    @contextmanager
    def collectives(self):
        """Around training collectives: a failed one raises PeerLost."""
        yield

    def failure(self, error: BaseException, where: str, hint: str) -> JobFailed:
        return JobFailed(f"{where}: {error}. {hint}", quiet=False)

    def report_failure(self, error: BaseException) -> None:
        pass

    def close(self) -> None:
        pass


_joined = 0  # TorchrunWorlds this process has made: the same count on every rank of the job


def from_environment() -> World:
    """A TorchrunWorld when torchrun's WORLD_SIZE > 1 is set, else the one-process World."""
    world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world_size > 1 and "RANK" not in os.environ:
        raise UserError(
            f"WORLD_SIZE={world_size} is set but RANK is not: launch with torchrun or gpulab launch "
            "(or set RANK, MASTER_ADDR and MASTER_PORT for every process)"
        )
    return TorchrunWorld() if world_size > 1 else World()


class TorchrunWorld(World):
    def __init__(self):
        import torch.distributed as dist

        env = os.environ
        self.rank = int(env["RANK"])
        self.world_size = int(env["WORLD_SIZE"])
        # Set by torchrun; a hand-made single-machine launch may leave them out.
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        threads = threads_per_rank(self.local_world_size)
        if threads:
            torch.set_num_threads(threads)
        # The store is the job's shared key-value table (hosted by torchrun's agent on node 0);
        # gpulab uses it before the process group exists and to name a failed rank afterwards.
        try:
            self.store = next(dist.rendezvous("env://", timeout=STARTUP_TIMEOUT))[0]
        except (dist.DistError, RuntimeError, ValueError) as e:
            where = f"{env.get('MASTER_ADDR', '?')}:{env.get('MASTER_PORT', '?')}"
            raise UserError(
                f"rank {self.rank} of {self.world_size} could not join the job's rendezvous at {where} within "
                f"{STARTUP_TIMEOUT.total_seconds():g} s ({one_line(e)}): start every rank with the same WORLD_SIZE, "
                "MASTER_ADDR and MASTER_PORT (torchrun and gpulab launch set them)"
            ) from None
        # Keys of this World only: the agent's store outlives it (a script may call train() twice,
        # torchrun may restart the workers), and an old key must never answer a new question.
        global _joined
        _joined += 1
        self.prefix = f"gpulab/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{_joined}/"
        self.connected = False
        self.agreements = 0  # all_or_none calls so far: the same count on every rank
        self.stopping = False  # True once a failure is being reported or the World closes: SIGTERM waits
        # torchrun sends SIGTERM to the other ranks when one fails: turn it into an exception so
        # they can say why they stop (only the main thread may install a handler).
        self.previous_sigterm = None
        if threading.current_thread() is threading.main_thread():
            self.previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self.stop_watchdog = threading.Event()
        self.watchdog = threading.Thread(target=self._watchdog, name="gpulab-watchdog", daemon=True)
        self.watchdog.start()

    # ------------------------------------------------------------------ set-up

    def connect(self, device: torch.device, backend: str = "auto", timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        backend = choose_backend(backend, device)
        self.backend, self.timeout_s = backend, timeout_s
        if device.type == "cuda":
            torch.cuda.set_device(device)
        # torch keeps its groups' addresses in the store under fixed names: a prefix of this
        # World's own, or a second World in the same job would connect to the first one's ports.
        dist.init_process_group(
            backend, store=dist.PrefixStore(self.prefix + "pg", self.store), rank=self.rank, world_size=self.world_size,
            timeout=STARTUP_TIMEOUT, device_id=device if backend == "nccl" else None,
        )
        self.connected = True
        # Steps get their own group and a short timeout: a dead or hung rank then fails the
        # others' next collective within timeout_s, while start-up keeps its long one.
        self.group_timeout = timedelta(seconds=timeout_s)
        self.group = dist.new_group(timeout=self.group_timeout, backend=backend)

    def share(self, key: str, compute: Callable[[], T]) -> T:
        key = self.prefix + "share/" + key
        if self.is_main:
            try:
                value = compute()
            except BaseException as e:
                message = str(e) if isinstance(e, UserError) else f"rank 0 failed: {one_line(e)}"
                self.store.set(key, pickle.dumps(("error", message)))
                raise
            self.store.set(key, pickle.dumps(("ok", value)))
            return value
        self._wait_for([key], lambda: "rank 0")
        status, value = pickle.loads(self.store.get(key))
        if status == "error":
            raise SharedError(value, printed_by=0)
        return value

    def all_or_none(self, fn: Callable[[], T]) -> T:
        # Through the store, not a collective: it works before the process group exists, and a
        # rank that fails here is never waited for inside one.
        error, result = None, None
        try:
            result = fn()
        except BaseException as e:  # a bug or Ctrl-C too: the others must not wait for this rank
            error = e
        self.agreements += 1
        keys = [self.prefix + f"agree/{self.agreements}/{r}" for r in range(self.world_size)]
        message = None if error is None else str(error) if isinstance(error, UserError) else one_line(error)
        self.store.set(keys[self.rank], pickle.dumps(message))
        self._wait_for(keys, lambda: "ranks " + ", ".join(str(r) for r, k in enumerate(keys) if not self.store.check([k])))
        messages = [pickle.loads(self.store.get(k)) for k in keys]
        failed = [r for r, m in enumerate(messages) if m]
        if not failed:
            return result
        first = failed[0]  # the lowest failing rank prints; a rank with another message prints its own
        if error is not None and (self.rank == first or messages[self.rank] != messages[first]):
            raise error
        raise SharedError(str(error) if error else f"rank {first}: {messages[first]}", printed_by=first)

    def _wait_for(self, keys: list[str], who: Callable[[], str]) -> None:
        """Wait for other ranks' keys in short slices, so that signals (torchrun's SIGTERM) get
        through; `who()` names the ranks still missing when the start-up timeout runs out."""
        import torch.distributed as dist

        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        while True:
            try:
                self.store.wait(keys, timedelta(seconds=1))
                return
            except dist.DistError as e:
                if not (isinstance(e, dist.DistStoreError) and "timeout" in str(e).lower()):
                    raise PeerLost(f"lost the rendezvous store: {one_line(e)}") from e  # its host is gone
                if time.monotonic() > deadline:
                    raise UserError(
                        f"rank {self.rank} waited {STARTUP_TIMEOUT.total_seconds():g} s during set-up for {who()}, "
                        "which never answered: see their output (or torchrun's summary)"
                    ) from None

    def local_main_first(self, fn: Callable[[], T]) -> T:
        result = None
        for turn_of_local_main in (True, False):
            mine = (self.local_rank == 0) == turn_of_local_main
            value = self.all_or_none(fn if mine else (lambda: None))
            if mine:
                result = value
        return result

    def broadcast(self, obj: T) -> T:
        import torch.distributed as dist

        box = [obj if self.is_main else None]
        with self.collectives():
            dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: T) -> list[T] | None:
        import torch.distributed as dist

        out = [None] * self.world_size if self.is_main else None
        with self.collectives():
            dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        """On the training group: bounded by --timeout like every collective once training runs."""
        import torch.distributed as dist

        with self.collectives():
            dist.barrier(group=self.group)

    def close(self) -> None:
        import torch.distributed as dist

        self.stopping = True  # a SIGTERM now must not replace the exception this rank is reporting
        self.stop_watchdog.set()
        self.watchdog.join(timeout=10)  # its store calls time out after 5 s
        if self.previous_sigterm is not None:
            signal.signal(signal.SIGTERM, self.previous_sigterm)
            self.previous_sigterm = None
        if self.connected:
            # gloo's worker threads free each finished collective's tensors, which needs the GIL;
            # a group destroyed meanwhile joins those threads while holding the GIL: a deadlock
            # (seen: 2 exits in 12). Give them the GIL first; no collective starts after this.
            time.sleep(0.2)
            dist.destroy_process_group()
            self.group = None  # the last reference: the group is freed now, not at interpreter exit
            self.connected = False

    # ------------------------------------------------------------------ failures

    @contextmanager
    def collectives(self):
        try:
            yield
        except RuntimeError as e:
            if is_communication_error(e):
                raise PeerLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
            raise

    def _on_sigterm(self, signum, frame) -> None:
        if not self.stopping:  # while a failure is being reported, or at close, finish that first
            raise Terminated()

    def report_failure(self, error: BaseException) -> None:
        """This rank is failing on its own: leave the reason where the survivors will look."""
        self.stopping = True
        try:
            self.store.set_timeout(timedelta(seconds=5))
            self.store.set(self.prefix + f"failed/{self.rank}", one_line(error))
        except Exception:
            pass  # the store may be gone with rank 0; the launcher's summary still has it

    def failure(self, error: BaseException, where: str, hint: str) -> JobFailed:
        """The one-line message for a rank that stops because another failed."""
        self.stopping = True
        alive, reasons = self._check_in()
        # Failed: ranks that left a reason, and ranks that did not answer the check-in.
        failed = sorted(set(reasons) | ({r for r in range(self.world_size) if r not in alive} if alive else set()))
        alive = [r for r in alive if r not in reasons]
        if failed:
            named = "; ".join(
                f"rank {r} failed: {reasons[r]}" if r in reasons else f"rank {r} stopped answering"
                for r in failed
            )
            cause = f"{named} (torchrun's summary shows how it exited)"
        elif isinstance(error, Terminated):
            cause = "stopped by SIGTERM (from the launcher, after another rank failed, or from a job scheduler)"
        else:
            cause = f"a collective failed: {error}"
        if isinstance(error, PeerLost) and "Timed out" in str(error):
            cause += f"; the step timeout is --timeout {self.timeout_s:g} s"
        quiet = bool(alive) and self.rank != min(alive)  # the lowest surviving rank speaks for all
        return JobFailed(f"{where}: {cause}. {hint}", quiet=quiet)

    def _watchdog(self) -> None:
        """Check this rank in when another raises the failure flag, even while the main thread
        is blocked in a collective or a store call. A dead or stopped process cannot: that is
        how it is found. Its own store client with a short timeout: it never waits behind the
        main thread's client, and never blocks the process from exiting for long."""
        import torch.distributed as dist

        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                timeout=timedelta(seconds=5), wait_for_workers=False,
            )
        except Exception:
            return  # no second connection: the check-in then sees this rank only if it answers itself
        flag = self.prefix + "failure"
        while not self.stop_watchdog.wait(WATCHDOG_POLL_S):
            try:
                if store.check([flag]):
                    store.set(self.prefix + f"alive/{self.rank}", b"1")
                    return
            except Exception:
                return  # the store is gone: nobody is left to ask

    def _check_in(self) -> tuple[list[int], dict[int, str]]:
        """Raise the failure flag, then see which ranks answer within CHECK_IN_S."""
        import torch.distributed as dist

        try:
            self.store.set_timeout(timedelta(seconds=5))
            self.store.set(self.prefix + "failure", b"1")
            self.store.set(self.prefix + f"alive/{self.rank}", b"1")
            keys = [self.prefix + f"alive/{r}" for r in range(self.world_size)]
            try:
                self.store.wait(keys, timedelta(seconds=CHECK_IN_S))  # returns as soon as all are in
            except dist.DistStoreError:
                pass  # someone is missing: find out who below
            alive = [r for r in range(self.world_size) if self.store.check([keys[r]])]
            reasons = {}
            for r in range(self.world_size):
                if self.store.check([self.prefix + f"failed/{r}"]):
                    reasons[r] = self.store.get(self.prefix + f"failed/{r}").decode()
            return alive, reasons
        except Exception:
            return [], {}  # the store went down with the rank that hosted it


def choose_backend(backend: str, device: torch.device) -> str:
    """nccl when the rank drives a GPU, else gloo; an explicit choice must fit the device."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"--backend nccl needs a GPU per rank, but the ranks run on {device}: use --backend gloo")
    return backend


def is_communication_error(e: BaseException) -> bool:
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(s in text for s in ("gloo", "NCCL", "Connection", "Timed out"))


def one_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".strip()


def threads_per_rank(local_world_size: int) -> int | None:
    """This machine's cores split between its ranks, or None where the user chose OMP_NUM_THREADS.

    torchrun sets OMP_NUM_THREADS=1 for every worker when the user did not set it; the
    launcher's own environment at start-up (our parent process's) tells the two apart."""
    if "OMP_NUM_THREADS" in os.environ:
        try:
            import psutil

            if "OMP_NUM_THREADS" in psutil.Process(os.getppid()).environ():
                return None  # the user's choice, passed through the launcher
        except Exception:
            return None  # cannot tell: respect the variable
    from gpulab.host import usable_cores

    return max(1, usable_cores() // local_world_size)
