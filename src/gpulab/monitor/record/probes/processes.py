"""The processes probe: the children a process forks (forked), how a multiprocessing child ends
(process_ending, and its target's exception), torch's threads under `--try threads=N`, and in the
"facts" snapshot how many threads torch uses and whether this process is a DataLoader worker.
"""

from __future__ import annotations

import multiprocessing.process
import os
import weakref

import torch

from gpulab.monitor.record.probe import Probe


class ProcessProbe(Probe):
    """`torch_threads`: torch's intra-op threads forced (`--try threads=N`); 0: as the script sets them."""

    def __init__(self, torch_threads: int):
        self._torch_threads = torch_threads
        self._installed = False

    def hook(self) -> None:
        self._installed = True
        self.patches.patch(multiprocessing.process.BaseProcess, "_bootstrap", self._ending_the_recording)
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)
            self.patches.patch(torch, "set_num_threads", self._forcing_torch_threads)
        self._follow_forks()

    def remove(self) -> None:
        self._installed = False
        super().remove()

    def facts(self) -> dict:
        return {"dataloader_worker": torch.utils.data.get_worker_info() is not None,
                "torch_threads": torch.get_num_threads()}

    def _ending_the_recording(self, original):
        """A multiprocessing child leaves with os._exit(), skipping atexit: its recording ends here.
        Its target's exception never reaches sys.excepthook either: it is noted on its way out of run()."""
        notices = self.sink.notices

        def _bootstrap(process, *args, **kwargs):
            run = process.run

            def run_noting_its_exception():
                try:
                    return run()
                except BaseException as e:
                    notices.exception.send(e, e.__traceback__)
                    raise

            process.run = run_noting_its_exception
            try:
                return original(process, *args, **kwargs)
            finally:
                notices.process_ending.send()

        return _bootstrap

    def _forcing_torch_threads(self, original):
        """`--try threads=N`: torch's intra-op threads are N, whatever the script sets."""
        def set_num_threads(requested: int) -> None:
            return original(self._torch_threads)

        return set_num_threads

    def _follow_forks(self) -> None:
        """forked, in a forked child (the recorder decides what it records). Fork handlers cannot be
        removed: this one holds the probe weakly and does nothing once the probe is removed."""
        if not hasattr(os, "register_at_fork"):  # not POSIX: nothing forks
            return
        ref = weakref.ref(self)

        def in_child() -> None:
            probe = ref()
            if probe is not None and probe._installed:
                probe.sink.notices.forked.send()

        os.register_at_fork(after_in_child=in_child)
