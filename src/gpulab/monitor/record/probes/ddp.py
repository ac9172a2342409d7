"""DistributedDataParallel's wait for its gradients' allreduce, inside backward (part of the
distributed probe, which hands it module_called and backward_ending).

DDP waits for its last buckets' allreduce at the end of backward, in C++ (an autograd callback)
where no Python hook reaches: the recorder would count that wait as compute. A public hook
(`Tensor.register_post_accumulate_grad_hook` on each parameter of a DDP module) shows when the
last gradient was ready; from then until backward returns the thread only hands the last bucket
to the allreduce, waits for it and copies the averaged gradients back: that part of backward is
a collective span of its own (WAIT_SPAN), at every step (DDP's own timers sample only some
iterations). On CUDA the hook runs when the gradient's kernels are queued: what is seen is the
host's wait, as everywhere in the step accounting.
"""

from __future__ import annotations

import time
import weakref

import torch
from torch.nn.parallel import DistributedDataParallel

from gpulab.monitor.events import DDP_WAIT_COUNT
from gpulab.monitor.record.sink import Sink

WAIT_SPAN = "DDP allreduce wait"


class DdpWait:
    def __init__(self, sink: Sink):
        self._sink = sink
        self._hooked: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._handles: list = []
        self._syncing = False  # the last DDP forward will allreduce its gradients (not inside no_sync())
        self._last_grad_t: float | None = None

    def module_called(self, module: torch.nn.Module, args) -> None:
        """A top-level module call (module_called): a DDP module's parameters get the hook once."""
        if not isinstance(module, DistributedDataParallel):
            return
        self._syncing = getattr(module, "require_backward_grad_sync", True)
        if module not in self._hooked:
            self._hooked.add(module)
            self._handles += [p.register_post_accumulate_grad_hook(self._gradient_ready)
                              for p in module.parameters() if p.requires_grad]

    def _gradient_ready(self, param: torch.Tensor) -> None:
        self._last_grad_t = time.perf_counter()

    def backward_ended(self) -> None:
        """The top-level backward returned: from its last DDP gradient to now, DDP waited for the allreduce."""
        t0, self._last_grad_t = self._last_grad_t, None
        if t0 is None or not self._syncing:
            return
        t1 = time.perf_counter()
        self._sink.steps.add_closed_span(WAIT_SPAN, "collective", t0, t1)
        self._sink.steps.count(DDP_WAIT_COUNT, t1 - t0)  # DDP's part of the collectives, in the report

    def remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()
