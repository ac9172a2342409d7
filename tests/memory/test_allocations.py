"""The allocator's records as the autograd profiler's event tree gives them (a private reader:
allocations.py owns it, and this pins what it returns on the installed torch)."""

import time

import torch

from gpulab.memory.allocations import Allocations, allocations_of


def profiled(body):
    profiler = torch.autograd.profiler.profile(use_cpu=True, profile_memory=True, use_kineto=True)
    with profiler:
        body()
    return profiler


def test_every_allocation_and_free_comes_with_its_address_size_and_time():
    seen = {}

    def body():
        seen["t0"] = time.time_ns()
        x = torch.empty(1000)  # 4000 bytes
        seen["ptr"], seen["noted"] = x.data_ptr(), time.time_ns()
        del x
        seen["t1"] = time.time_ns()

    records = allocations_of(profiled(body), torch.device("cpu"))
    mine = [(t, n) for t, n in records.changes_between(seen["t0"], seen["t1"])]
    assert (4000 in [n for _, n in mine]) and (-4000 in [n for _, n in mine])
    assert records.size_at(seen["ptr"], seen["noted"]) == 4000
    freed = records.freed_after(seen["ptr"], seen["noted"])
    assert freed is not None and seen["noted"] <= freed + 50_000 and freed <= seen["t1"]


def test_a_reused_address_is_told_apart_by_time():
    # two allocations at one address: the free that counts is the one after the allocation noted
    ms = 1_000_000  # ns
    records = Allocations([(100 * ms, 7, 64), (200 * ms, 7, -64), (300 * ms, 7, 32), (400 * ms, 7, -32),
                           (150 * ms, 9, 8)])
    assert records.size_at(7, 120 * ms) == 64 and records.freed_after(7, 120 * ms) == 200 * ms
    assert records.size_at(7, 350 * ms) == 32 and records.freed_after(7, 350 * ms) == 400 * ms
    assert records.size_at(9, 160 * ms) == 8 and records.freed_after(9, 160 * ms) is None  # still live
    assert records.size_at(5, 100 * ms) is None  # never seen: made before the recording
    assert Allocations([(500 * ms, 5, -16)]).freed_after(5, 100 * ms) == 500 * ms  # ... and freed during it
    assert records.changes_between(150 * ms, 300 * ms) == [(150 * ms, 8), (200 * ms, -64), (300 * ms, 32)]
