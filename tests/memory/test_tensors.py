"""What tensors hold, read safely: storage spans from plain integers, and the storages the
script's objects reach - against what Python and torch themselves say."""

import sys
import warnings
import weakref

import torch
from torch import nn

from gpulab.memory.tensors import MAX_OBJECTS, Storages, frame_locals, reachable_from, script_roots, storage_span


def test_a_storage_is_counted_once_whatever_views_of_it_are_seen():
    weight = torch.zeros(1000)            # 4000 bytes
    found = Storages(torch.device("cpu"))
    assert found.add(weight[10:20]) == 80  # a slice reaches 20 floats of it
    assert found.add(weight) == 3920       # the whole storage raises its size, counted once
    assert found.add(weight.view(10, 100).t()) == 0
    assert found.nbytes == weight.untyped_storage().nbytes()


def test_a_span_is_read_from_integers_and_matches_the_storage():
    x = torch.randn(6, 8)
    (device, base), nbytes = storage_span(x)
    assert device == "cpu" and base == x.untyped_storage().data_ptr() and nbytes == x.untyped_storage().nbytes()
    (_, view_base), view_bytes = storage_span(x[2:, 1:5])
    assert view_base == base and view_bytes == (5 * 8 + 4 + 1) * 4  # up to its last element
    assert storage_span(torch.empty(0)) is None or storage_span(torch.empty(0))[1] == 0


def test_tensors_without_data_of_their_own_are_not_read():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fake = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Accessing the data pointer of FakeTensor is deprecated"
        assert storage_span(fake) is None
    assert storage_span(torch.empty(3, device="meta")) is None
    assert storage_span(torch.randn(4, 4).to_sparse()) is None
    assert storage_span(nn.Parameter(torch.randn(3))) is not None  # a plain subclass has real data


def _reached(*roots):
    return reachable_from(list(roots), torch.device("cpu"))


def test_the_walk_finds_what_the_script_holds_and_nothing_else():
    model = nn.Linear(100, 10)                     # 4000 + 40 bytes
    model(torch.randn(2, 100)).sum().backward()    # gradients: as much again
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer.step()                               # momentum: as much again
    dataset = {"train": [torch.zeros(250)]}        # 1000 bytes, two containers down
    unreachable = torch.ones(500)
    found = _reached({"model": model, "optimizer": optimizer, "data": dataset})
    params = 4040
    assert found.nbytes == 3 * params + 1000
    assert storage_span(unreachable)[0] not in found.bytes_by_key


def test_the_walk_starts_from_the_frames_of_the_script():
    kept_here = torch.zeros(256)  # a local of this frame: 1024 bytes
    found = reachable_from(script_roots(sys._getframe()), torch.device("cpu"))
    assert storage_span(kept_here)[0] in found.bytes_by_key


def test_the_walk_leaves_the_frames_holding_nothing_more():
    """Read through f_locals, a function's locals stay on its frame until it reads them again: a
    batch the loop has replaced, a tensor the script deleted, would live on."""
    batch = torch.zeros(256)
    replaced = weakref.ref(batch)
    reachable_from(script_roots(sys._getframe()), torch.device("cpu"))
    batch = torch.ones(256)
    assert replaced() is None
    deleted = torch.zeros(256)
    gone = weakref.ref(deleted)
    assert frame_locals(sys._getframe())["deleted"] is deleted
    del deleted
    assert gone() is None


def test_a_function_s_own_locals_dict_is_left_as_it_is():
    kept = torch.zeros(4)
    mine = locals()  # the same dict as the frame's snapshot: the function may read it later
    frame_locals(sys._getframe())
    assert mine["kept"] is kept


def test_the_walk_keeps_no_reference_and_stops_at_its_limit():
    held = [torch.zeros(10) for _ in range(100)]
    refs = [sys.getrefcount(t) for t in held]
    assert len(_reached(held).bytes_by_key) == 100
    assert [sys.getrefcount(t) for t in held] == refs
    assert len(reachable_from([held], torch.device("cpu"), max_objects=11).bytes_by_key) == 10
    assert MAX_OBJECTS >= 100_000
