"""The trainer-phases probe: gpulab's own trainer reports its phases through PhaseTimer
(gpulab.train.step.add_phase_listener, once that module is imported), each a span of its category.
"""

from __future__ import annotations

from gpulab.monitor.record.interpreter import after_import
from gpulab.monitor.record.probe import Probe

PHASE_CATEGORY = {
    "data": "data_wait",
    "scatter": "h2d",
    "forward_backward": "compute",
    "allreduce": "collective",
    "optimizer": "compute",
}


class TrainerPhasesProbe(Probe):
    def hook(self) -> None:
        self.patches.on_undo(after_import("gpulab.train.step", self._listen_to_phases))

    def _listen_to_phases(self, phases) -> None:
        self.patches.on_undo(phases.add_phase_listener(self._phase))

    def _phase(self, name: str):
        return self.sink.span(name, PHASE_CATEGORY.get(name, "compute"))
