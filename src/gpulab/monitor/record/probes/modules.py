"""The modules probe: nn.Module calls, through torch's global forward pre/post hooks
(always_call: the span also ends when forward raises).

The outermost module call is a compute span and a module_called notice; its return is progress
(an evaluation loop is no hang). Once, at such a call after the first step, it notes how the math
runs (facts "math": autocast's dtype, channels_last weights, native bf16 on the device), so that
the report's advice to make the math cheaper names only what the loop does not do yet.

A module called inside a DataLoader fetch is a transform: while
the transforms probe wants them (fetch_modules_wanted), it hears of each (fetch_module_entered /
_exited). In every other fetch, and in the iterator's start (where DataLoader workers are forked),
the hooks are paused: global hooks send every module call through torch's slow path (~1.3 us
each), which per-sample transforms pay per sample, enough to move a loop's data share by points.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _BaseDataLoaderIter

from gpulab.devices import native_bf16
from gpulab.monitor.record.probe import Probe


class ModuleProbe(Probe):
    def __init__(self):
        self._in_forward = False  # inside the outermost module call: inner calls add nothing but cost
        self._open_calls: list[tuple[torch.nn.Module, int | None]] = []  # (module, span token; None: in a fetch)
        self._fetch_modules_wanted = False
        self._math: dict | None = None

    def facts(self) -> dict:
        return {"math": self._math} if self._math is not None else {}

    def hook(self) -> None:
        hooks = PausableHooks(register_module_forward_pre_hook(self._make_before()),
                              register_module_forward_hook(self._make_after(), always_call=True))
        self.patches.on_undo(hooks.remove)
        # torch warns that global hooks fire for a compiled module's wrapper too; these expect it (the
        # wrapper is the outermost call) and the warning is about gpulab, not the script.
        self.patches.filter_warnings("ignore", r"Using `torch\.compile\(module\)` when there are global hooks")
        self.patches.patch(DataLoader, "__iter__", self._paused_in(hooks, lambda: True))
        self.patches.patch(_BaseDataLoaderIter, "__next__",
                           self._paused_in(hooks, lambda: not self._fetch_modules_wanted))
        self.listen(self.sink.notices.fetch_modules_wanted, self._wanted)

    def new_lane(self) -> None:
        """A forked lane starts outside any module call."""
        self._in_forward = False
        self._open_calls.clear()

    def _wanted(self, wanted: bool) -> None:
        self._fetch_modules_wanted = wanted

    def _make_before(self):
        sink, steps, open_calls = self.sink, self.sink.steps, self._open_calls
        is_compiling = torch.compiler.is_compiling
        module_called = sink.notices.module_called.send
        fetch_module_entered = sink.notices.fetch_module_entered.send

        def before(module, args):
            if is_compiling() or self._in_forward or not sink.here():
                return
            if steps.loading_data():
                if self._fetch_modules_wanted:
                    open_calls.append((module, None))
                    fetch_module_entered(module)
                return
            steps.end_step_after_backward()
            module_called(module, args)
            if self._math is None and steps.index >= 1:
                self._math = how_the_math_runs(module, args)
            self._in_forward = True
            open_calls.append((module, steps.enter(type(module).__name__, "compute")))

        return before

    def _make_after(self):
        sink, steps, open_calls = self.sink, self.sink.steps, self._open_calls
        is_compiling = torch.compiler.is_compiling
        fetch_module_exited = sink.notices.fetch_module_exited.send
        progress = sink.notices.progress.send

        def after(module, args, output):
            # is_compiling() first: torch.compile traces global hooks, and folds this one away here.
            if is_compiling() or not open_calls or open_calls[-1][0] is not module:
                return
            _, token = open_calls.pop()
            if token is None:
                fetch_module_exited()
            else:
                self._in_forward = False
                steps.exit(token)
                progress()

        return after

    def _paused_in(self, hooks: "PausableHooks", pause):
        """A make_wrapper: the original with the module hooks paused, in the recorded thread when `pause()`."""
        sink = self.sink

        def make_wrapper(original):
            def wrapper(*args, **kwargs):
                if not (sink.here() and pause()):
                    return original(*args, **kwargs)
                hooks.pause()
                try:
                    return original(*args, **kwargs)
                finally:
                    hooks.resume()

            return wrapper

        return make_wrapper


def how_the_math_runs(module: torch.nn.Module, args) -> dict:
    """Autocast's dtype on the input's device (None: off), whether the 4-D weights are channels_last
    (None: no 4-D weight with more than one input channel, where the layouts differ), and whether
    the device computes bf16 natively (a CPU without it emulates bf16, ~3x slower)."""
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    device = x.device if x is not None else torch.device("cpu")
    kind = device.type
    weights = [p for p in module.parameters() if p.dim() == 4 and p.size(1) > 1]
    return {
        "device": kind,
        "autocast": str(torch.get_autocast_dtype(kind)).removeprefix("torch.") if torch.is_autocast_enabled(kind) else None,
        "channels_last": all(w.is_contiguous(memory_format=torch.channels_last) for w in weights) if weights else None,
        "bf16_native": native_bf16(device),
    }


class PausableHooks:
    """Global hooks that can be paused: taken out of torch's hook dicts (the ones each hook's
    RemovableHandle removes it from) and put back under the same key. Not remove() and a new
    registration: that gives them a new key each time, and torch.compile, which guards on those
    keys, then recompiles the model at every call."""

    def __init__(self, *handles):
        self._handles = handles
        self._paused: list[tuple[dict, int, object]] = []  # (torch's dict, key, value)
        self._depth = 0  # nested pauses (a fetch inside a fetch): the outermost one resumes

    def pause(self) -> None:
        self._depth += 1
        if self._depth > 1:
            return
        for handle in self._handles:
            for ref in (handle.hooks_dict_ref, *handle.extra_dict_ref):
                hooks = ref()
                if hooks is not None and handle.id in hooks:
                    self._paused.append((hooks, handle.id, hooks.pop(handle.id)))

    def resume(self) -> None:
        self._depth -= 1
        if self._depth > 0:
            return
        for hooks, key, value in self._paused:
            hooks[key] = value
        self._paused.clear()

    def remove(self) -> None:
        for hooks, key, value in self._paused:  # stopped during a pause (an exception in a fetch)
            hooks[key] = value
        self._paused.clear()
        for handle in self._handles:
            handle.remove()
