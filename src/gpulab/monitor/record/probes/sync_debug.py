"""torch's sync debug mode as the CUDA probe's sync detector: torch reports every synchronizing
operation it knows of as a warning (`torch.cuda.set_sync_debug_mode("warn")`); gpulab intercepts
those warnings (the user never sees them) and passes each on to `on_sync_reported()`.

Turning the mode on needs CUDA initialised, and gpulab must not initialise it itself (a script
that never uses the GPU must not get a CUDA context, or fork-unsafe DataLoader workers): it is
queued for the script's first CUDA call (torch.cuda._lazy_call), or, with a torch that has no
such queue, turned on at the first step end after CUDA is up.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import torch

from gpulab.monitor.record.patches import Patches

SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncDebugMode:
    def __init__(self, on_sync_reported: Callable[[], None]):
        self._on_sync_reported = on_sync_reported
        self._installed = False
        self.on = False  # torch's sync debug mode is on (our sync detector)
        self.used = False  # ... and was, at some point of the session
        self._previous_mode = 0

    def install(self, patches: Patches) -> None:
        """Intercept the sync warnings, and turn the mode on once CUDA is up, until patches.undo()."""
        self._installed = True
        # "always": Python's default shows a warning once per line, and every sync counts.
        patches.filter_warnings("always", re.escape(SYNC_WARNING))
        original = warnings.showwarning

        def showwarning(message, category, filename, lineno, file=None, line=None):
            if str(message).startswith(SYNC_WARNING):
                self._on_sync_reported()
                return
            original(message, category, filename, lineno, file, line)

        warnings.showwarning = showwarning
        patches.on_undo(lambda: setattr(warnings, "showwarning", original)
                        if warnings.showwarning is showwarning else None)
        patches.on_undo(self._turn_off)
        lazy_call = getattr(torch.cuda, "_lazy_call", None)
        if lazy_call is not None:
            lazy_call(self.enable)

    def enable(self) -> None:
        """Turn the mode on (once CUDA is initialised)."""
        if self.on or not self._installed:  # on already, or uninstalled before CUDA came up
            return
        try:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            # Turning the mode on warns once that it "is a prototype feature": a note to gpulab,
            # not to the user, whose stderr it would otherwise reach.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
                torch.cuda.set_sync_debug_mode("warn")
            self.on = self.used = True
        except (AttributeError, RuntimeError):
            self.on = False

    def _turn_off(self) -> None:
        self._installed = False
        if self.on and torch.cuda.is_initialized():
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self.on = False
