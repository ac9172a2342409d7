"""The scan for reachable tensors, against what Python itself says is alive."""

import gc
import sys
import threading

import torch

from gpulab.memory.tensors import reachable_tensors


def readable_address(t: torch.Tensor) -> int:
    """A storage's address, 0 for tensors whose data cannot be read (a FakeTensor left by an ONNX
    export, a storage FSDP freed), which hold no bytes of their own."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def test_reachable_tensors_counts_every_live_storage_once():
    weight = torch.zeros(1000)            # 4000 bytes
    view = weight[10:20]                  # same storage: not counted again
    other = torch.ones(250)               # 1000 bytes
    before = reachable_tensors(torch.device("cpu")).bytes_by_key
    assert before[("cpu", weight.untyped_storage().data_ptr())] == 4000
    assert before[("cpu", other.untyped_storage().data_ptr())] == 1000
    # type(), not isinstance(): isinstance reads __class__, and torch.distributed.reduce_op's
    # deprecation proxy warns when asked
    tensors = [t for t in gc.get_objects() if issubclass(type(t), torch.Tensor)]
    expected = {("cpu", ptr) for t in tensors if t.device.type == "cpu" and (ptr := readable_address(t))}
    assert set(before) == expected
    del view


def test_the_scan_keeps_no_reference_to_anything():
    alive = (object(), [1, 2])
    refs = sys.getrefcount(alive)
    reachable_tensors(torch.device("cpu"))
    assert sys.getrefcount(alive) == refs


def test_the_scan_does_not_break_a_thread_building_tuples():
    """gc.get_objects() sees tuples under construction; a thread switch while its list lives made
    the other thread's tuple(...) raise SystemError (36 of 40 scans before the fix)."""
    errors, stop = [], threading.Event()

    def build_tuples():
        while not stop.is_set():
            try:
                tuple(str(i) for i in range(50))
            except SystemError as e:
                errors.append(e)

    builder = threading.Thread(target=build_tuples, daemon=True)
    builder.start()
    try:
        for _ in range(20):
            reachable_tensors(torch.device("cpu"))
    finally:
        stop.set()
        builder.join()
    assert errors == []
