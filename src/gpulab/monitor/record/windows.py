"""The measurement windows take turns: after warm-up the kernel window (CUDA), then the memory
window, then the transform window, one at a time - two torch profilers cannot run at once, and a
step measured by one window would carry another's cost. Their steps are left out of the
statistics (the steps are marked "profiled").

Each window opens only when no earlier one holds it back: the kernel window while it runs or is
about to (CUDA in use, not done yet), the others while they run.
"""

from __future__ import annotations

from gpulab.monitor.record.probe import WindowProbe


class MeasurementWindows:
    def __init__(self, windows: list[WindowProbe]):
        self._windows = windows  # in the order they take their turns

    def pending(self) -> bool:
        """Has any window still something to do in this lane? Most of a run has none: then the
        recorder skips them between steps."""
        return not all(window.finished for window in self._windows)

    def on_step_end(self, steps_done: int) -> bool:
        """Let each window open, measure or close; whether the next step is inside one."""
        may_open = True
        for window in self._windows:
            window.on_step_end(steps_done, may_open)
            may_open = may_open and not window.holds_back_later_windows
        return any(window.active for window in self._windows)
