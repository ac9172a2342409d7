"""The autograd and optimizer probe: backward, autograd.grad, the optimizers' step and zero_grad,
each a compute span, and the two step rules they carry (steps.py). Why each patch is one:
docs/profiling.md. A CUDA graph that captured an optimizer step (a whole step captured with
torch.cuda.graph) did not run it; each replay of that graph does, with no Python call to hook:
the replay is the optimizer step (gpulab train --compile graphs).
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from gpulab.monitor.record.probe import Probe, timed


class AutogradProbe(Probe):
    def __init__(self):
        self._in_backward = False  # inside the top-level backward: inner calls add nothing but cost
        self._optimizer_tokens: dict[int, int] = {}  # id(optimizer) -> its open step span
        self._capturing = None  # the CUDA graph being recorded in the recorded thread
        self._graph_steps: dict[int, object] = {}  # id(CUDA graph) -> the optimizer it recorded a step of

    def hook(self) -> None:
        self.patches.patch(torch.autograd, "backward", self._timed_backward("backward"))
        self.patches.patch(torch.autograd, "grad", self._timed_backward("autograd.grad"))
        self.patches.patch(torch.optim.Optimizer, "zero_grad",
                           timed(self.sink, "compute", lambda optimizer: f"{type(optimizer).__name__}.zero_grad"))
        for handle in (register_optimizer_step_pre_hook(self._optimizer_step_begins),
                       register_optimizer_step_post_hook(self._optimizer_step_ended)):
            self.patches.on_undo(handle.remove)
        self.patches.patch(torch.cuda.CUDAGraph, "capture_begin", self._capture_begins)
        self.patches.patch(torch.cuda.CUDAGraph, "capture_end", self._capture_ends)
        self.patches.patch(torch.cuda.CUDAGraph, "replay", self._replayed)

    def new_lane(self) -> None:
        """A forked lane starts outside backward, with no optimizer step open and no graph recording."""
        self._in_backward = False
        self._optimizer_tokens = {}
        self._capturing = None

    def _timed_backward(self, name: str):
        sink, steps = self.sink, self.sink.steps
        is_compiling = torch.compiler.is_compiling
        backward_ending = sink.notices.backward_ending.send

        def make_wrapper(original):
            def wrapper(*args, **kwargs):
                if self._in_backward or is_compiling() or not sink.here_or_adopted():
                    return original(*args, **kwargs)
                steps.end_step_after_backward()  # a loop with neither a DataLoader nor a module call
                self._in_backward = True
                token = steps.enter(name, "compute")
                try:
                    return original(*args, **kwargs)
                finally:
                    self._in_backward = False
                    backward_ending()  # DDP's wait for its allreduce, at the end of backward
                    steps.exit(token)
                    steps.backward_done()

            return wrapper

        return make_wrapper

    # is_compiling() first in both: torch.compile traces the global optimizer hooks into a compiled
    # optimizer step (torch's step wrapper calls them), where they fold away as torch's own would.

    def _optimizer_step_begins(self, optimizer, args, kwargs) -> None:
        if not torch.compiler.is_compiling() and self.sink.here_or_adopted():
            self._optimizer_tokens[id(optimizer)] = self.sink.steps.enter(f"{type(optimizer).__name__}.step", "compute")

    def _optimizer_step_ended(self, optimizer, args, kwargs) -> None:
        if torch.compiler.is_compiling() or not self.sink.here():
            return
        token = self._optimizer_tokens.pop(id(optimizer), None)
        if token is not None:
            self.sink.steps.exit(token)
        if self._capturing is not None:  # recorded, not run: the graph's replays are the steps
            self._graph_steps.setdefault(id(self._capturing), optimizer)
        else:
            self._stepped(optimizer)

    def _stepped(self, optimizer) -> None:
        self.sink.notices.optimizer_stepped.send(optimizer)  # first: a step that ends here may open the memory window
        self.sink.steps.optimizer_stepped(optimizer)

    def _capture_begins(self, original):
        def wrapper(graph, *args, **kwargs):
            if self.sink.here():
                self._capturing = graph
            return original(graph, *args, **kwargs)

        return wrapper

    def _capture_ends(self, original):
        def wrapper(graph, *args, **kwargs):
            try:
                return original(graph, *args, **kwargs)
            finally:
                if self._capturing is graph:
                    self._capturing = None

        return wrapper

    def _replayed(self, original):
        def wrapper(graph, *args, **kwargs):
            result = original(graph, *args, **kwargs)
            optimizer = self._graph_steps.get(id(graph))
            if optimizer is not None and self.sink.here():
                self._stepped(optimizer)
            return result

        return wrapper
