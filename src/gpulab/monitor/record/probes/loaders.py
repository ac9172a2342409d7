"""The data-loading probe: every DataLoader's iter() and fetches as data wait, the line that built
each loader, its real batch size, and which one the training steps waited on (patches: torch.utils.data
has no hooks). A pass's start - iter() and its first batch, which waits for worker processes to
start - is also counted apart (PASS_START_COUNT): loaders without persistent_workers pay it every epoch.

Frameworks make this harder than it looks (docs/profiling.md, Which DataLoader): Lightning runs
its validation loader first and re-creates the user's loaders under DDP; Accelerate iterates a
DataLoader of its own, with a batch sampler (its `batch_size` is None). So a loader is credited
with each step whose last batch came from it; a framework's copy of a loader takes the line of
the live one it copied, else the framework's own line and the user's line that led there; the
batch size comes from the batch sampler where the DataLoader has none.
"""

from __future__ import annotations

import inspect
import os
import sys
import time
import weakref
from types import FrameType

from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpulab.memory.tensors import frame_locals
from gpulab.monitor.events import PASS_START_COUNT, PASSES_COUNT, LoaderRecord, LoaderUseRecord
from gpulab.monitor.record.frames import format_site, is_user_file, user_site
from gpulab.monitor.record.probe import Probe, timed


class LoaderProbe(Probe):
    """`overrides`: DataLoader arguments forced on every loader (`--try num_workers=2`)."""

    def __init__(self, overrides: dict):
        self._overrides = overrides
        self.loaders: Loaders | None = None

    def hook(self) -> None:
        sink = self.sink
        loaders = self.loaders = Loaders(sink.emit)
        batch_fetched = sink.notices.batch_fetched.send

        def next_batch(iterator):  # the loop is back for data: a backward-rule step ended; then this fetch
            sink.steps.end_step_after_backward()
            loaders.fetching(iterator)

        def fetched(batch):
            loaders.fetched(sink.steps.count)
            batch_fetched(batch)

        self.patches.patch(DataLoader, "__init__", self._building)
        self.patches.patch(DataLoader, "__iter__", self._iterating)
        self.patches.patch(_BaseDataLoaderIter, "__next__",
                           timed(sink, "data_wait", "next(DataLoader)", next_batch, after=fetched))
        self.listen(self.sink.notices.step_ended, lambda steps_done: loaders.step_ended())

    def new_lane(self) -> None:
        self.loaders.new_lane()

    def snapshots(self) -> list[dict]:
        return [self.loaders.snapshot()] if self.loaders is not None else []  # none before install

    def _building(self, original):
        """Every DataLoader built, in any thread: the line that built it; `--try`'s settings forced."""
        overrides, loaders = self._overrides, self.loaders
        signature = inspect.signature(original)

        def __init__(loader, *args, **kwargs):
            if overrides:
                bound = signature.bind(loader, *args, **kwargs)
                bound.apply_defaults()
                bound.arguments.update(overrides)
                if not bound.arguments.get("num_workers"):  # these only exist with workers
                    bound.arguments["persistent_workers"] = False
                    bound.arguments["prefetch_factor"] = None
                args, kwargs = bound.args[1:], bound.kwargs
            original(loader, *args, **kwargs)
            loaders.built(loader, sys._getframe(1))

        return __init__

    def _iterating(self, original):
        """A new pass over a DataLoader: a data wait (its workers start here), after a backward-rule
        step ended (the loop is back for data); which iterator is the loader's."""
        sink, loaders = self.sink, self.loaders
        timed_iter = timed(sink, "data_wait", "DataLoader.__iter__")(original)
        loader_iterated = sink.notices.loader_iterated.send

        def __iter__(loader):
            if not sink.here():  # not timed; noted: the training thread may wait on a queue it feeds
                iterator = original(loader)
                loaders.iterated(loader, iterator, sys._getframe(1), elsewhere=sink.ident is not None)
                loader_iterated(iterator)
                return iterator
            sink.steps.end_step_after_backward()
            t0 = time.perf_counter()
            iterator = timed_iter(loader)
            sink.steps.count(PASS_START_COUNT, time.perf_counter() - t0)
            sink.steps.count(PASSES_COUNT)
            loaders.iterated(loader, iterator, sys._getframe(1), started=t0)
            loader_iterated(iterator)
            return iterator

        return __iter__


class Loaders:
    """The loaders seen, where each was built, and the steps each fed."""

    def __init__(self, emit):
        self._emit = emit
        # loader -> the line that built it; kept across a fork (a child iterates its parent's loaders)
        self._built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.new_lane()

    def new_lane(self) -> None:
        """What each process tallies for itself (a forked lane starts again from here)."""
        self._index: dict[tuple, int] = {}  # a loader's record -> its place (re-made each epoch: one loader)
        # id(iterator) -> (a weak reference to it, [its loader's place, whether its first batch is still
        # to come]). Not a WeakKeyDictionary: its callback is a Python frame that runs where the
        # iterator dies, inside a compiled function too, where torch.compile would count it as the
        # script's; the entries of dead iterators go when the next one is added.
        self._iterators: dict[int, tuple[weakref.ref, list]] = {}
        self._steps_fed: list[int] = []
        self._last: int | None = None  # the loader of the latest fetch in this step
        self._first_fetch_since: float | None = None  # perf_counter when a pass's first fetch began
        # Per loader, its passes, and the seconds from each of its iter() and fetches to the next
        # loader call or step end: what the loop did with its batches (for a loader that feeds no
        # step, an evaluation); `_working_on`: (the loader, since) whose seconds run now.
        self._passes: list[int] = []
        self._pass_seconds: list[float] = []
        self._working_on: tuple[int, float] | None = None

    def built(self, loader, caller: FrameType) -> None:
        """DataLoader.__init__ returned (`caller`: the frame that called it)."""
        builder = _builder(loader, caller)
        if builder is None or is_user_file(builder.f_code.co_filename):
            site = user_site(builder)
        else:
            site = self._copied_from(loader) or _framework_site(builder)
        self._built[loader] = site

    def _copied_from(self, loader) -> str | None:
        """The line of the live loader a framework's loader copies: the first one over the same
        dataset - with the same batch size, where two are (a training and an evaluation loader)."""
        same_data = [(other, site) for other, site in self._built.items() if other.dataset is loader.dataset]
        same_batches = [site for other, site in same_data if batch_size(other) == batch_size(loader)]
        return next(iter(same_batches or [site for _, site in same_data]), None)

    def iterated(self, loader, iterator, caller: FrameType, elsewhere: bool = False, started: float | None = None) -> None:
        """DataLoader.__iter__, called at `started` (None: not timed, `elsewhere`: not in the
        training thread), returned `iterator` to `caller`."""
        record: LoaderRecord = {
            "type": "loader",
            "where": user_site(caller),
            "built": self._built.get(loader),
            "dataset": type(loader.dataset).__name__,
            "batch_size": batch_size(loader),
            "num_workers": loader.num_workers,
            "pin_memory": bool(loader.pin_memory),
            "persistent_workers": bool(loader.persistent_workers),
            "elsewhere": elsewhere,
        }
        key = tuple(record.values())
        index = self._index.get(key)
        if index is None:
            index = self._index[key] = len(self._steps_fed)
            self._steps_fed.append(0)
            self._passes.append(0)
            self._pass_seconds.append(0.0)
            self._emit(record)
        if started is not None:
            self._passes[index] += 1
            self._work_on(index, started)
        try:
            ref = weakref.ref(iterator)
        except TypeError:  # a subclass's iterator that takes no weak reference: its steps go uncounted
            return
        self._iterators = {key: (r, entry) for key, (r, entry) in self._iterators.items() if r() is not None}
        self._iterators[id(iterator)] = (ref, [index, True])

    def _work_on(self, index: int | None, now: float) -> None:
        """From `now` the loop works on loader `index`'s batches (None: on none of them)."""
        if self._working_on is not None:
            was, since = self._working_on
            self._pass_seconds[was] += max(0.0, now - since)
        self._working_on = (index, now) if index is not None else None

    def fetching(self, iterator) -> None:
        """next() on a DataLoader's iterator (after the step it ends, if any, was counted)."""
        found = self._iterators.get(id(iterator))  # one lookup per fetch, on the hot path
        entry = found[1] if found is not None and found[0]() is iterator else None
        self._last, first = (entry[0], entry[1]) if entry is not None else (None, False)
        if first:
            entry[1] = False
        now = time.perf_counter()
        self._first_fetch_since = now if first else None
        if self._last is not None:
            self._work_on(self._last, now)

    def fetched(self, count) -> None:
        """next() returned a batch: the first of its pass adds its wait to the pass's start."""
        if self._first_fetch_since is not None:
            count(PASS_START_COUNT, time.perf_counter() - self._first_fetch_since)
            self._first_fetch_since = None

    def step_ended(self) -> None:
        """The step trained on the latest batch fetched in it."""
        if self._last is not None:
            self._steps_fed[self._last] += 1
            self._last = None
        self._work_on(None, time.perf_counter())

    def snapshot(self) -> LoaderUseRecord:
        return {"type": "loader_use", "steps_fed": list(self._steps_fed), "passes": list(self._passes),
                "pass_seconds": [round(s, 6) for s in self._pass_seconds]}


def batch_size(loader) -> int | None:
    """Samples per batch: the DataLoader's own, else its batch sampler's (Accelerate's
    BatchSamplerShard with split_batches gives each process a slice of it)."""
    if loader.batch_size is not None:
        return loader.batch_size
    sampler = loader.batch_sampler
    size = getattr(sampler, "batch_size", None)
    if isinstance(size, int) and getattr(sampler, "split_batches", False):
        size //= max(1, getattr(sampler, "num_processes", 1))
    return size if isinstance(size, int) else None


def _builder(loader, frame: FrameType | None) -> FrameType | None:
    """The frame that asked for `loader`: the first one above the calls that construct it (its
    __init__ chain, a framework's wrapper), which all take it as their first argument."""
    while frame is not None:
        code = frame.f_code
        if not (code.co_argcount and frame_locals(frame).get(code.co_varnames[0]) is loader):
            return frame
        frame = frame.f_back
    return None


def _framework_site(frame: FrameType) -> str:
    """A framework's line that built a loader, and the user's line that led there."""
    user = user_site(frame)
    return f"{_library_site(frame)} (from {user})" if user else _library_site(frame)


def _library_site(frame: FrameType) -> str:
    """A library's line, from its package down ("accelerate/data_loader.py:441")."""
    filename = frame.f_code.co_filename
    package = str(frame.f_globals.get("__name__", "")).split(".")[0]
    at = filename.rfind(f"{os.sep}{package}{os.sep}") if package else -1
    return f"{filename[at + 1:]}:{frame.f_lineno}" if at >= 0 else format_site(filename, frame.f_lineno)
