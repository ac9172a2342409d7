"""The allocator's own records of a profiled stretch: every allocation and free, with its address,
size and time, for one device.

torch's autograd profiler with profile_memory=True records each allocation of torch's allocators
(the CPU's and CUDA's caching allocator) as an event whose extra fields carry the address, the
size (negative for a free) and the device. Its public face, `key_averages()` and the kineto
events, keeps the sizes and drops the addresses; the event tree
(`kineto_results.experimental_event_tree()`, the reader torch's own memory profiler uses) keeps
both. That is the one private API here, and this module is its only reader;
tests/memory/test_allocations.py pins what it returns.

Knowing when each storage was freed is what lets the probe split a step's memory by category
without holding anything on the script's tensors.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import torch

# A storage noted a moment after its allocation was recorded: the allocation it belongs to is the
# last one at its address that started before the note (plus this much, for the two clocks'
# rounding: both are wall-clock nanoseconds, read at different instants).
_NOTE_SLACK_NS = 50_000


class Allocations:
    """(wall-clock ns, address, bytes) of each allocation (bytes > 0) and free (bytes < 0), in time order."""

    def __init__(self, events: list[tuple[int, int, int]]):
        self.events = sorted(events)
        self._times = [t for t, _, _ in self.events]
        self._at: dict[int, list[tuple[int, int]]] = defaultdict(list)  # address -> [(t, bytes)], in time order
        for t, ptr, nbytes in self.events:
            self._at[ptr].append((t, nbytes))

    def changes_between(self, t0_ns: int, t1_ns: int) -> list[tuple[int, int]]:
        """(time, bytes) of every allocation and free from t0 to t1."""
        lo, hi = bisect.bisect_left(self._times, t0_ns), bisect.bisect_right(self._times, t1_ns)
        return [(t, nbytes) for t, _, nbytes in self.events[lo:hi]]

    def _allocated_before(self, ptr: int, t_ns: int) -> int | None:
        """Index in _at[ptr] of the allocation live at t_ns (the last one started by then), if recorded."""
        found = None
        for i, (t, nbytes) in enumerate(self._at.get(ptr, ())):
            if t > t_ns + _NOTE_SLACK_NS:
                break
            if nbytes > 0:
                found = i
        return found

    def allocated_at(self, ptr: int, t_ns: int) -> int | None:
        """When the allocation at `ptr` live at t_ns was made, if it was made while recording."""
        i = self._allocated_before(ptr, t_ns)
        return self._at[ptr][i][0] if i is not None else None

    def size_at(self, ptr: int, t_ns: int) -> int | None:
        """The size of the allocation at `ptr` live at t_ns, if it was made while recording."""
        i = self._allocated_before(ptr, t_ns)
        return self._at[ptr][i][1] if i is not None else None

    def freed_after(self, ptr: int, t_ns: int) -> int | None:
        """When the allocation at `ptr` live at t_ns was freed (None: not while recording). For
        one made before the recording began, the first free at `ptr` after t_ns."""
        records = self._at.get(ptr, ())
        i = self._allocated_before(ptr, t_ns)
        later = records[i + 1:] if i is not None else [r for r in records if r[0] >= t_ns]
        return next((t for t, nbytes in later if nbytes < 0), None)


def allocations_of(profiler: torch.autograd.profiler.profile, device: torch.device) -> Allocations:
    """The allocations and frees a stopped profiler recorded on `device`."""
    device = torch.device(device)
    events = []
    todo = list(profiler.kineto_results.experimental_event_tree())
    while todo:
        event = todo.pop()
        todo.extend(event.children)
        fields = event.extra_fields
        if type(fields).__name__ != "_ExtraFields_Allocation" or not _same_device(fields.device, device):
            continue
        events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    return Allocations(events)


def _same_device(recorded: torch.device, device: torch.device) -> bool:
    if recorded.type != device.type:
        return False
    return device.type != "cuda" or (recorded.index or 0) == (device.index or 0)
