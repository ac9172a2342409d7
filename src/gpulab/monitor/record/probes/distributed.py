"""The distributed probe: time inside torch.distributed's collectives and Work.wait, as
"collective" (c10d has no Python-level hook per call), each then progress for the hang watch;
this process's rank once its process group is up (a "rank" record, rank_known); and DDP's wait
for its allreduce at the end of backward (ddp.py).
"""

from __future__ import annotations

import sys
import time

import torch

from gpulab.monitor.events import RankRecord
from gpulab.monitor.record.probe import Probe, timed
from gpulab.monitor.record.probes.ddp import DdpWait

# torch.distributed calls that block until the collective is done (unless async_op=True, when the
# wait comes later, in Work.wait). Each is timed as "collective".
DISTRIBUTED_CALLS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "reduce", "barrier", "monitored_barrier",
    "all_to_all", "all_to_all_single", "gather", "scatter", "gather_object", "scatter_object_list",
    "send", "recv",
)


class DistributedProbe(Probe):
    def hook(self) -> None:
        ddp = DdpWait(self.sink)
        self.patches.on_undo(ddp.remove_hooks)  # the gradient hooks it puts on DDP modules' parameters
        self.listen(self.sink.notices.module_called, ddp.module_called)
        self.listen(self.sink.notices.backward_ending, ddp.backward_ended)
        if torch.distributed.is_available():
            # Here, not at the top: torch builds without distributed support have no c10d to import.
            import torch.distributed.distributed_c10d as c10d

            self._time_collectives(c10d)
            self._note_the_rank(c10d)

    def _time_collectives(self, c10d) -> None:
        collective_done = self.sink.notices.progress.send
        for name in DISTRIBUTED_CALLS:
            if not hasattr(c10d, name):
                continue
            original = getattr(c10d, name)
            wrapper = timed(self.sink, "collective", f"dist.{name}", after=lambda result: collective_done())(original)
            # `dist.all_reduce` and `c10d.all_reduce` are one function under two names: patch both.
            for owner in (c10d, torch.distributed):
                if getattr(owner, name, None) is original:
                    self.patches.patch(owner, name, lambda orig, w=wrapper: w)
        self.patches.patch(torch._C._distributed_c10d.Work, "wait",
                           timed(self.sink, "collective", "Work.wait", after=lambda result: collective_done()))

    def _note_the_rank(self, c10d) -> None:
        """init_process_group, patched under every name torch's modules call it by (device_mesh's too)."""
        original = c10d.init_process_group
        note = self._process_group_up

        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            note()
            return result

        for owner in [m for name, m in list(sys.modules.items())
                      if name.startswith("torch.distributed") and getattr(m, "init_process_group", None) is original]:
            self.patches.patch(owner, "init_process_group", lambda orig, w=init_process_group: w)

    def _process_group_up(self) -> None:
        """The default group is up, in any thread: this process's rank, however the job was launched
        (Lightning's DDP, mp.spawn and others pass it to init_process_group, not in RANK)."""
        dist = torch.distributed
        record: RankRecord = {"type": "rank", "t": time.perf_counter(), "rank": dist.get_rank(),
                              "world_size": dist.get_world_size()}
        self.sink.emit(record)
        self.sink.notices.rank_known.send(record["rank"])
