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
- When another rank fails, each survivor says which one, where, and how to go on: the failure
  protocol of `gpulab.parallel.failures` (`collectives`, `failure`, `report_failure`).
- What one rank receives from another is data, never code: messages through the store are JSON,
  objects through the process group (a checkpoint, parity results) travel as torch.save's bytes
  read back with `weights_only=True`. Whoever reaches the store's port can still disturb the job
  (it belongs on a private network, as torchrun's does), but cannot run code in it.
"""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from datetime import timedelta
from typing import TypeVar

import torch

from gpulab.errors import UserError
from gpulab.host import let_gloo_workers_finish
from gpulab.parallel.failures import FailureProtocol, JobFailed, PeerLost, is_communication_error, one_line
from gpulab.parallel.launch import exit_summary

T = TypeVar("T")
STARTUP_TIMEOUT = timedelta(minutes=10)


class SharedError(UserError):
    """An error every rank raises together; the rank that printed it is named in `printed_by`.
    The CLI prints it on that rank only, so a job of K ranks says it once."""

    def __init__(self, message: str, printed_by: int = 0):
        super().__init__(message)
        self.printed_by = printed_by


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

    def agree(self, values: dict, what: str) -> None:
        """Every process must hold the same `values` (`what` they are: "gpulab train options");
        if they differ, every process raises one error naming each difference and its ranks."""

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
        """Around training collectives: one that failed because of another rank raises PeerLost."""
        yield

    def failure(self, error: BaseException, where: str, hint: str) -> JobFailed:
        """The one line to stop with after PeerLost or Terminated (`where` it happened, `hint`
        how to go on), naming the rank that failed."""
        return JobFailed(f"{where}: {error}. {hint}", quiet=False)

    def report_failure(self, error: BaseException) -> None:
        """This rank is failing on its own (`error`): let the others name it and its reason."""

    def close(self) -> None:
        pass


def differing_values(per_rank: list[dict]) -> str:
    """'--epochs 3 on ranks 0, 1 but 2 on rank 2; --lr ...' for every key whose value differs."""
    parts = []
    for key in per_rank[0]:
        ranks_by_value: dict[str, list[int]] = {}
        for rank, values in enumerate(per_rank):
            ranks_by_value.setdefault(str(values.get(key)), []).append(rank)
        if len(ranks_by_value) > 1:
            parts.append(f"{key} " + " but ".join(
                f"{value} on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
                for value, ranks in ranks_by_value.items()))
    return "; ".join(parts)


_joined = 0  # TorchrunWorlds this process has made: the same count on every rank of the job


def from_environment() -> World:
    """A TorchrunWorld when torchrun's WORLD_SIZE > 1 is set, else the one-process World."""
    world_size = env_int("WORLD_SIZE", 1, minimum=1)
    if world_size > 1 and "RANK" not in os.environ:
        raise UserError(
            f"WORLD_SIZE={world_size} is set but RANK is not: launch with torchrun or gpulab launch "
            "(or set RANK, MASTER_ADDR and MASTER_PORT for every process)"
        )
    return TorchrunWorld() if world_size > 1 else World()


def env_int(name: str, default: int, minimum: int = 0, below: int | None = None) -> int:
    """A whole number from torchrun's environment (`default` when unset), or one line naming the
    variable: a hand-made launch may set anything."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum or (below is not None and value >= below):
        bound = f"from {minimum} to {below - 1}" if below is not None else f"{minimum} or more"
        raise UserError(f"{name}={text[:40]}: not a whole number {bound}; launch with torchrun or gpulab launch, which "
                        "set it, or set it to one")
    return value


class TorchrunWorld(World):
    def __init__(self):
        import torch.distributed as dist

        env = os.environ
        self.world_size = env_int("WORLD_SIZE", 1, minimum=1)
        self.rank = env_int("RANK", 0, below=self.world_size)
        # Set by torchrun; a hand-made single-machine launch may leave them out.
        self.local_world_size = env_int("LOCAL_WORLD_SIZE", self.world_size, minimum=1)
        self.local_rank = env_int("LOCAL_RANK", self.rank, below=self.local_world_size)
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
        # From here on SIGTERM raises Terminated and a watchdog answers the others' check-ins.
        self.failures = FailureProtocol(self.store, self.prefix, self.rank, self.world_size)

    # ------------------------------------------------------------------ set-up

    def connect(self, device: torch.device, backend: str = "auto", timeout_s: float = 60.0) -> None:
        import torch.distributed as dist

        backend = choose_backend(backend, device)
        self.backend = backend
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
        self.failures.step_timeout_s = timeout_s

    def share(self, key: str, compute: Callable[[], T]) -> T:
        key = self.prefix + "share/" + key
        if self.is_main:
            try:
                value = compute()
            except BaseException as e:
                message = str(e) if isinstance(e, UserError) else f"rank 0 failed: {one_line(e)}"
                self.store.set(key, json.dumps(["error", message]))
                raise
            self.store.set(key, json.dumps(["ok", value]))
            return value
        self._wait_for([key], lambda: "rank 0")
        status, value = self._read(key, 2)
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
        self.store.set(keys[self.rank], json.dumps(message))
        self._wait_for(keys, lambda: "ranks " + ", ".join(str(r) for r, k in enumerate(keys) if not self.store.check([k])))
        messages = [self._read(k) for k in keys]
        failed = [r for r, m in enumerate(messages) if m]
        if not failed:
            return result
        first = failed[0]  # the lowest failing rank prints; a rank with another message prints its own
        if error is not None and (self.rank == first or messages[self.rank] != messages[first]):
            raise error
        raise SharedError(str(error) if error else f"rank {first}: {messages[first]}", printed_by=first)

    def agree(self, values: dict, what: str) -> None:
        # Through the store, before any collective: ranks that disagree (on the epochs, the model)
        # would otherwise fail in a collective much later, or train different things in silence.
        self.agreements += 1
        keys = [self.prefix + f"same/{self.agreements}/{r}" for r in range(self.world_size)]
        self.store.set(keys[self.rank], json.dumps(values))
        self._wait_for(keys, lambda: "ranks " + ", ".join(str(r) for r, k in enumerate(keys) if not self.store.check([k])))
        differences = differing_values([self._read(k) for k in keys])
        if differences:
            raise SharedError(f"the ranks were started with different {what}: {differences}; start every rank "
                              "with the same ones", printed_by=0)

    def _read(self, key: str, items: int | None = None):
        """A message another rank wrote under `key` (JSON); one line if it is not one (`items`:
        the length of the list it must be)."""
        try:
            value = json.loads(self.store.get(key))
        except (ValueError, RecursionError):
            value = None
        else:
            if items is None or (isinstance(value, list) and len(value) == items):
                return value
        raise UserError(f"rank {self.rank}: the job's rendezvous store holds a malformed message under {key!r}: another "
                        "program writes to the store's port; run the job on a private network")

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
                        f"which never answered: see their output (or {exit_summary()})"
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

        device = self._object_device()
        with self.collectives():
            size = torch.tensor([0], dtype=torch.int64, device=device)
            data = to_bytes(obj, device) if self.is_main else None
            if self.is_main:
                size[0] = len(data)
            dist.broadcast(size, src=0)
            if not self.is_main:
                data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
            dist.broadcast(data, src=0)
        return obj if self.is_main else from_bytes(data)

    def gather(self, obj: T) -> list[T] | None:
        import torch.distributed as dist

        device = self._object_device()
        data = to_bytes(obj, device)
        with self.collectives():
            # Every rank's size first: all_gather wants one size, so each sends its bytes padded.
            sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(self.world_size)]
            dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=device))
            longest = int(max(s.item() for s in sizes))
            padded = torch.zeros(longest, dtype=torch.uint8, device=device)
            padded[:len(data)] = data
            every = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(self.world_size)]
            dist.gather(padded, every if self.is_main else None, dst=0)
        if not self.is_main:
            return None
        return [obj if r == self.rank else from_bytes(b[:int(s.item())]) for r, (b, s) in enumerate(zip(every, sizes))]

    def _object_device(self) -> torch.device:
        """Where an object's bytes travel: NCCL moves GPU tensors only."""
        return torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        """On the training group: bounded by --timeout like every collective once training runs."""
        import torch.distributed as dist

        with self.collectives():
            dist.barrier(group=self.group)

    def close(self) -> None:
        import torch.distributed as dist

        self.failures.close()  # a SIGTERM from now on must not replace the exception this rank is reporting
        if self.connected:
            let_gloo_workers_finish()  # else a deadlock (seen: 2 exits in 12); no collective starts after this
            dist.destroy_process_group()
            self.group = None  # the last reference: the group is freed now, not at interpreter exit
            self.connected = False

    # ------------------------------------------------------------------ failures

    @contextmanager
    def collectives(self):
        try:
            yield
        except RuntimeError as e:
            self.failures.raise_if_terminated()  # a dropped SIGTERM: the others are stopping too
            if is_communication_error(e):
                raise PeerLost(str(e).splitlines()[0] if str(e) else type(e).__name__) from e
            raise
        self.failures.raise_if_terminated()

    def report_failure(self, error: BaseException) -> None:
        self.failures.report(error)

    def failure(self, error: BaseException, where: str, hint: str) -> JobFailed:
        return self.failures.failure(error, where, hint)


def to_bytes(obj, device: torch.device) -> torch.Tensor:
    """An object as torch.save's bytes in a uint8 tensor (tensors, numbers, strings, lists and
    dicts of them: what the ranks exchange)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)


def from_bytes(data: torch.Tensor):
    """to_bytes' object back, read with weights_only: data, never code."""
    return torch.load(io.BytesIO(data.cpu().numpy().tobytes()), weights_only=True)


def choose_backend(backend: str, device: torch.device) -> str:
    """nccl when the rank drives a GPU, else gloo; an explicit choice must fit the device."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl" and device.type != "cuda":
        raise UserError(f"--backend nccl needs a GPU per rank, but the ranks run on {device}: use --backend gloo")
    return backend


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
