"""A forked child is a lane of its own, whatever the parent was doing when another of its threads
forked it."""

from __future__ import annotations

import os
import threading

import pytest

from gpulab.monitor.config import ProfileConfig
from gpulab.monitor.record.recorder import Recorder

pytestmark = [pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX"),
              pytest.mark.shares_the_cores]  # no timing at all


def test_a_child_forked_while_the_parent_is_in_gpulab_s_own_work_records_its_own_steps(tmp_path):
    """The training thread is inside gpulab's own work (a measurement window) when another thread
    forks: in the child, that work is not under way, and the forking thread's calls count."""
    recorder = Recorder(ProfileConfig(memory_window=False, stack_interval_s=0),
                        events_path=tmp_path / f"events-{os.getpid()}.jsonl").start(command=["test"])
    read, write = os.pipe()
    try:
        with recorder.sink.own_work():
            def fork_from_a_helper_thread():
                if (pid := os.fork()) == 0:
                    os.write(write, b"1" if recorder.sink.here() else b"0")
                    os._exit(0)
                os.waitpid(pid, 0)

            helper = threading.Thread(target=fork_from_a_helper_thread)
            helper.start()
            helper.join()
        assert os.read(read, 1) == b"1"
    finally:
        os.close(read)
        os.close(write)
        recorder.stop(exit_code=0)
