"""CUDA_VISIBLE_DEVICES read the way CUDA reads it (gpulab.hardware.visible), the one reader that
`gpulab devices` and the profiler's sampler share."""

from __future__ import annotations

import pytest

from gpulab.hardware.visible import Selected, parse_cuda_visible_devices

H100 = "GPU-0db07a0e-dc2d-4caa-5b67-461cdb9ae06e"
A100 = "GPU-11111111-2222-3333-4444-555555555555"
MIG_1 = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"
MIG_2 = "MIG-aaaaffff-bbbb-cccc-dddd-eeeeeeeeeeee"


def picked(value, uuids=(H100, A100), migs=()) -> list[int]:
    return [s.nvml_index for s in parse_cuda_visible_devices(value, list(uuids), migs)]


@pytest.mark.parametrize(
    "value, indices",
    [("1,0", [1, 0]), ("0,5,1", [0]), ("", []), ("-1", []), ("GPU-1111", [1]), ("gpu-1111", [1]), ("GPU-", []),
     (" 1 , 0 ", [1, 0]), ("0,,1", [0]), ("0,cuda:1", [0])],
)
def test_entries_are_read_as_cuda_reads_them(value, indices):
    assert picked(value) == indices


def test_unset_selects_every_gpu():
    assert picked(None) == [0, 1]


@pytest.mark.parametrize("value", ["0,0", "1,0,1", "GPU-1111,0,GPU-1111"])
def test_a_repeated_entry_hides_every_gpu(value):
    assert picked(value) == []


def test_an_ambiguous_prefix_stops_the_list_there():
    twins = ["GPU-abcd0000-0000", "GPU-abcd1111-0000"]
    assert picked("1,GPU-abcd,0", twins) == [1]  # GPU-abcd names both: CUDA stops there
    assert picked("GPU-abcd1,0", twins) == [1, 0]


def test_a_mig_instance_is_named_by_its_uuid_and_belongs_to_its_gpu():
    migs = [[], [MIG_1, MIG_2]]
    assert parse_cuda_visible_devices("MIG-aaaaaaaa", [H100, A100], migs) == [Selected(1, MIG_1)]
    assert parse_cuda_visible_devices(f"0,{MIG_2}", [H100, A100], migs) == [Selected(0), Selected(1, MIG_2)]
    assert picked("MIG-aaaa,0", migs=migs) == []  # both instances start so: ambiguous, nothing before it
    assert picked("MIG-aaaaaaaa") == []  # no instance: names nothing


def test_a_gpu_whose_uuid_is_unreadable_is_still_selectable_by_index():
    assert picked("1", [None, A100]) == [1]
    assert picked("GPU-1111", [None, A100]) == [1]
