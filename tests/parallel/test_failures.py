"""The failure protocol's parts that need no second rank (tests/parallel/test_torchrun.py kills real ones)."""

from __future__ import annotations

import os
import signal
import weakref

import pytest
import torch.distributed as dist

from gpulab.parallel.failures import FailureProtocol, Terminated, is_communication_error


@pytest.mark.parametrize("message", [
    # What torch 2.13's gloo raised (a plain RuntimeError) when the other rank was killed, or hung
    # past the group's timeout, in all_reduce, barrier, broadcast_object_list and gather_object.
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:25823. This is typically caused by a remote worker crashing.",
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms "
    "for recv operation to complete",
])
def test_gloo_failures_are_communication_errors(message):
    assert is_communication_error(RuntimeError(message))


def test_torch_distributed_errors_are_communication_errors_and_a_step_s_own_are_not():
    assert is_communication_error(dist.DistBackendError("NCCL communicator was aborted"))
    assert is_communication_error(dist.DistStoreError("wait timeout"))
    assert not is_communication_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x2)"))
    assert not is_communication_error(RuntimeError("Connection refused while downloading the data"))


def test_a_sigterm_dropped_inside_a_weakref_callback_is_raised_again(capsys):
    """Python drops an exception raised in a weakref callback; the next collective raises it."""
    before = signal.getsignal(signal.SIGTERM)
    failures = FailureProtocol(store=None, prefix="", rank=0, world_size=1)  # no MASTER_ADDR: no watchdog
    try:
        class Thing:
            pass

        thing = Thing()
        ref = weakref.ref(thing, lambda _: os.kill(os.getpid(), signal.SIGTERM))  # the handler runs in the callback
        del thing
        assert ref() is None
        assert "Traceback" not in capsys.readouterr().err
        with pytest.raises(Terminated):
            failures.raise_if_terminated()
    finally:
        failures.close()
    assert signal.getsignal(signal.SIGTERM) == before  # close() put the previous handler back
