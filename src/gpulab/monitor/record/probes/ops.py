"""The operators probe: torch operators the training thread calls outside any nn.Module, timed in
a window of steps, for a CPU loop whose model is written with torch functions (F.conv2d,
torch.mm over a list of weights, as the textbook's chapters write it).

gpulab charges compute to what it can see: a module's forward, backward, an optimizer's step.
A forward made of torch functions is none of these, so its time lands in "other" - on a CPU,
where an operator returns when its work is done, the whole forward pass. Without a measurement
the report would call it Python between the training calls and advise vectorizing.

The window opens after warm-up only where no nn.Module was called, nothing was compiled, and the
process never used CUDA (there an operator's call is its launch, and the kernel window says what
the device did). For WINDOW_STEPS steps a profile function (sys.setprofile, the training
thread's only) charges each torch function or tensor method called from "other" as a compute
span named OPS_SPAN, and notes the seconds of each user line that called them; the report takes
the lines whose time is mostly such operators, and their share of "other", for compute
(analyze/step_costs.py). Operators reached through Python operators (`a + b`, `p -= g`) call no
function the profile function sees: they stay with their line.
"""

from __future__ import annotations

import sys
import time

import torch

from gpulab.monitor.events import OPS_SPAN
from gpulab.monitor.record.frames import user_site
from gpulab.monitor.record.probe import PhasedWindow

WINDOW_STEPS = 3


class OpsProbe(PhasedWindow):
    """`enabled`: open the window where it is wanted (ProfileConfig.operators_window)."""

    def __init__(self, enabled: bool, warmup_steps: int):
        self._enabled, self._warmup_steps = enabled, warmup_steps
        self.new_lane()

    def after_fork(self) -> None:
        """A child forked while the window was open (a DataLoader worker) keeps the forking
        thread's profile function: not in it."""
        if self._phase == "window":
            self._unprofile()
            self._token, self._phase = None, "done"

    def new_lane(self) -> None:
        self._wanted = self._enabled
        self._phase = "warm-up"  # -> "window" -> "done"
        self._window_ends = 0
        self._steps: list[int] = []
        self._lines: dict[str, float] = {}  # the user's lines that called them -> the operators' seconds
        self._where: str | None = None  # the line of the operator running, since when
        self._since = 0.0
        self._depth = 0  # C calls under way inside the profile function's view
        self._token: int | None = None  # the open span, if a torch operator is running

    def hook(self) -> None:
        self.listen(self.sink.notices.module_called, self._not_wanted)
        self.listen(self.sink.notices.compiled, self._not_wanted)

    def _not_wanted(self, *what) -> None:
        """A module ran (its forward is compute already), or torch.compile compiled: compiled code
        runs its operators where no profile function sees them."""
        self._wanted = False

    def on_step_end(self, steps_done: int, may_open: bool) -> None:
        if self._phase == "warm-up" and steps_done >= self._warmup_steps and may_open:
            wanted = self._wanted and not torch.cuda.is_initialized() and sys.getprofile() is None
            self._phase = "window" if wanted else "done"
            if wanted:
                self._window_ends = steps_done + WINDOW_STEPS
                self._steps = list(range(steps_done, self._window_ends))
                sys.setprofile(self._profile)
        elif self._phase == "window" and steps_done >= self._window_ends:
            self._close()

    def finish(self) -> None:
        if self._phase == "window":
            self._close()

    def remove(self) -> None:
        self.finish()
        super().remove()

    def facts(self) -> dict:
        if not self._steps:
            return {}
        return {"ops_window_steps": self._steps, "ops_lines": {where: round(s, 6) for where, s in self._lines.items()}}

    def _unprofile(self) -> None:
        if sys.getprofile() == self._profile:  # not one the script has set since
            sys.setprofile(None)

    def _close(self) -> None:
        self._unprofile()
        if self._token is not None:
            self.sink.steps.exit(self._token)
            self._token = None
        self._phase = "done"

    def _profile(self, frame, event: str, arg) -> None:
        if event == "c_call":
            if self._depth == 0 and _is_torch_operator(arg) and self.sink.here() \
                    and self.sink.steps.charged_category() == "other":
                self._token = self.sink.steps.enter(OPS_SPAN, "compute")
                self._where, self._since = user_site(frame), time.perf_counter()
            self._depth += 1
        elif event in ("c_return", "c_exception") and self._depth:
            self._depth -= 1
            if self._depth == 0 and self._token is not None:
                self.sink.steps.exit(self._token)
                self._token = None
                if self._where:
                    self._lines[self._where] = self._lines.get(self._where, 0.0) + time.perf_counter() - self._since


def _is_torch_operator(function) -> bool:
    """A torch function (torch.mm, F.conv2d's torch.conv2d, torch._C._nn.linear) or a method of a
    tensor; not torch._C's own machinery (torch._C._has_torch_function, which Tensor.backward calls)."""
    owner = getattr(function, "__self__", None)
    if isinstance(owner, torch.Tensor):
        return True
    # whatever a C function says of itself: an exception here would be raised in the script's own call
    module = getattr(function, "__module__", None)
    return isinstance(module, str) and (module == "torch" or module.startswith("torch._C._"))
