"""gpulab.devices: device specs, placement vs copying."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

from gpulab import devices
from gpulab.errors import UserError

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only fallback")

CPU = torch.device("cpu")
Point = namedtuple("Point", "x y")


# ----------------------------------------------------------------------------- resolve


def test_resolve_cpu():
    assert devices.resolve("cpu") == [CPU]


@pytest.mark.parametrize("spec", ["auto", "all", " AUTO "])
def test_resolve_auto_is_every_gpu_else_cpu(spec):
    expected = [torch.device(f"cuda:{i}") for i in range(devices.num_gpus())] or [CPU]
    assert devices.resolve(spec) == expected


@pytest.mark.parametrize("k", [1, 2, 4])
def test_resolve_virtual_cpu_replicas(k):
    assert devices.resolve(f"cpu*{k}") == [CPU] * k


def test_resolve_cpu_times_zero_is_an_error():
    with pytest.raises(UserError, match=r"cpu\*K with K >= 1"):
        devices.resolve("cpu*0")


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cpu*", "cpu*-1", "gpu0"])
def test_resolve_unknown_spec_lists_what_exists(spec):
    with pytest.raises(UserError) as info:
        devices.resolve(spec)
    message = str(info.value)
    assert "unknown device" in message
    assert "available: cpu" in message
    assert "\n" not in message


@pytest.mark.parametrize("spec", ["", " ", ","])
def test_resolve_empty_spec(spec):
    with pytest.raises(UserError, match="empty device spec"):
        devices.resolve(spec)


def test_resolve_real_device_listed_twice_is_an_error():
    with pytest.raises(UserError, match="lists a device twice"):
        devices.resolve("cpu,cpu")


@no_gpu
@pytest.mark.parametrize("spec", ["cuda", "gpu", "cuda:0", "gpu:2", "cuda:0,cuda:1"])
def test_resolve_unavailable_gpu_lists_what_exists(spec):
    with pytest.raises(UserError) as info:
        devices.resolve(spec)
    message = str(info.value)
    assert "not available" in message
    assert "available: cpu (no CUDA GPU visible to torch)" in message


@needs_gpu
@pytest.mark.parametrize("spec", ["cuda", "gpu", "cuda:0", "gpu:0"])
def test_resolve_first_gpu(spec):
    assert devices.resolve(spec) == [torch.device("cuda:0")]


@needs_gpu
def test_resolve_gpu_past_the_last_one_is_an_error():
    n = devices.num_gpus()
    with pytest.raises(UserError, match=f"cuda:{n - 1}"):
        devices.resolve(f"gpu:{n}")


@needs_gpu
def test_resolve_same_gpu_twice_is_an_error():
    with pytest.raises(UserError, match="twice"):
        devices.resolve("cuda:0,gpu:0")


@needs_2_gpus
def test_resolve_gpu_list():
    assert devices.resolve("cuda:0,cuda:1") == [torch.device("cuda:0"), torch.device("cuda:1")]
    assert devices.resolve("gpu:1") == [torch.device("cuda:1")]


def test_format_devices():
    assert devices.format_devices([CPU]) == "[cpu]"
    assert devices.format_devices([CPU] * 3) == "[cpu*3]"
    assert devices.format_devices([torch.device("cuda:0"), torch.device("cuda:1")]) == "[cuda:0, cuda:1]"


# ----------------------------------------------------------------------------- try_gpu


@no_gpu
def test_try_gpu_falls_back_to_cpu():
    assert devices.try_gpu() == CPU
    assert devices.try_gpu(3) == CPU


@no_gpu
def test_try_all_gpus_is_cpu_never_empty():
    assert devices.try_all_gpus() == [CPU]


@needs_gpu
def test_try_gpu_with_gpus():
    n = devices.num_gpus()
    assert devices.try_gpu(0) == torch.device("cuda:0")
    assert devices.try_gpu(n) == CPU
    assert devices.try_all_gpus() == [torch.device(f"cuda:{i}") for i in range(n)]


# ----------------------------------------------------------------------------- place and copy_to


def test_place_tensor_already_there_is_identity():
    x = torch.arange(4.0)
    assert devices.place(x, "cpu") is x
    assert devices.place(x, CPU) is x


def test_place_module_already_there_is_identity():
    m = nn.Linear(2, 3)
    weight = m.weight
    assert devices.place(m, CPU) is m
    assert m.weight is weight


@pytest.mark.parametrize(
    "make",
    [
        lambda: [torch.ones(1), torch.zeros(2)],
        lambda: (torch.ones(1), [torch.zeros(2), {"w": torch.ones(3)}]),
        lambda: {"x": torch.ones(1), "nested": [torch.zeros(2), (nn.Linear(1, 1),)]},
        lambda: OrderedDict(a=torch.ones(1)),
    ],
    ids=["list", "tuple-nested", "dict-nested", "ordereddict"],
)
def test_place_nested_already_there_is_identity(make):
    x = make()
    placed = devices.place(x, CPU)
    assert placed is x
    # and every leaf is the original object too
    assert len(_leaves(placed)) == len(_leaves(x))
    assert all(a is b for a, b in zip(_leaves(placed), _leaves(x)))


def test_place_moves_only_what_is_elsewhere():
    here, there = torch.ones(2), torch.ones(2, device="meta")
    point = Point(here, there)
    placed = devices.place([here, there, point], "meta")
    assert placed[0].device.type == "meta" and placed[0] is not here
    assert placed[1] is there
    assert isinstance(placed[2], Point) and placed[2].y is there and placed[2].x.device.type == "meta"
    assert here.device == CPU  # a tensor is never moved in place


def test_place_rejects_other_types():
    with pytest.raises(TypeError, match="cannot move a str"):
        devices.place(["a"], CPU)


def test_copy_to_same_device_is_a_new_tensor_with_its_own_storage():
    x = torch.arange(5.0)
    y = devices.copy_to(x, CPU)
    assert y is not x
    assert torch.equal(y, x)
    assert y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y[0] = 100.0
    assert x[0] == 0.0


def test_copy_to_module_is_independent():
    m = nn.Linear(2, 2)
    c = devices.copy_to(m, CPU)
    assert c is not m
    assert torch.equal(c.weight, m.weight)
    with torch.no_grad():
        c.weight.add_(1.0)
    assert not torch.equal(c.weight, m.weight)


def test_copy_to_nested_copies_every_leaf():
    x = {"a": torch.ones(2), "b": [torch.zeros(3), (torch.full((1,), 7.0),)]}
    y = devices.copy_to(x, "cpu")
    assert y is not x
    assert isinstance(y, dict) and isinstance(y["b"], list) and isinstance(y["b"][1], tuple)
    for a, b in zip(_leaves(x), _leaves(y)):
        assert a is not b and torch.equal(a, b)
    y["b"][1][0].fill_(-1.0)
    assert x["b"][1][0].item() == 7.0


def test_copy_to_namedtuple_keeps_its_type():
    p = Point(torch.ones(1), torch.zeros(1))
    c = devices.copy_to(p, CPU)
    assert isinstance(c, Point) and c is not p
    assert c.x is not p.x and torch.equal(c.x, p.x)


def test_check_same_device_on_one_device():
    assert devices.check_same_device(torch.ones(1), torch.ones(2)) == CPU


def test_check_same_device_mixed_is_an_error():
    a, b = torch.ones(1), torch.ones(1, device="meta")
    with pytest.raises(UserError) as info:
        devices.check_same_device(a, b)
    message = str(info.value)
    assert "different devices (cpu, meta)" in message
    assert "place" in message


def test_device_of_module_spread_over_devices_is_an_error():
    m = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1))
    m[1].to("meta")
    with pytest.raises(UserError, match="several devices"):
        devices.device_of(m)


@needs_gpu
def test_place_and_copy_to_gpu():
    x = torch.arange(3.0)
    g = devices.place(x, "cuda:0")
    assert g.device == torch.device("cuda:0")
    assert devices.place(g, "cuda:0") is g
    assert devices.place(g, "cuda") is g  # cuda means the current GPU, cuda:0 here
    assert devices.copy_to(g, "cuda:0") is not g
    assert torch.equal(devices.place(g, "cpu"), x)


@needs_gpu
def test_check_same_device_cpu_and_gpu():
    with pytest.raises(UserError, match="different devices"):
        devices.check_same_device(torch.ones(1), torch.ones(1, device="cuda:0"))


def _leaves(x) -> list:
    if isinstance(x, dict):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, list | tuple):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def test_resolve_accepts_torchs_name_for_the_cpu():
    assert devices.resolve("cpu:0") == [torch.device("cpu")]


@pytest.mark.parametrize("index, error", [(-1, ValueError), ("0", TypeError), (True, TypeError), (0.0, TypeError)])
def test_a_gpu_index_that_is_no_whole_number_from_0_is_refused(index, error):
    """try_gpu(-1) was torch's 'Invalid device string', try_gpu("0") a TypeError about '<', and
    gpu("0") quietly cuda:0."""
    with pytest.raises(error, match="a GPU index is a whole number from 0"):
        devices.gpu(index)
    with pytest.raises(error, match="a GPU index is a whole number from 0"):
        devices.try_gpu(index)


def test_copy_to_and_place_keep_a_dict_s_own_kind():
    """A defaultdict was rebuilt by calling its type on the items: TypeError."""
    from collections import defaultdict

    batch = defaultdict(list, {"x": torch.ones(2)})
    copied = devices.copy_to(batch, devices.cpu())
    assert type(copied) is defaultdict and copied.default_factory is list and copied["x"] is not batch["x"]
    assert torch.equal(copied["x"], batch["x"]) and copied["missing"] == []
    ordered = OrderedDict(b=torch.ones(1), a=torch.zeros(1))
    assert list(devices.copy_to(ordered, devices.cpu())) == ["b", "a"] and devices.place(ordered, devices.cpu()) is ordered
