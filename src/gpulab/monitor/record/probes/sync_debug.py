"""torch's sync debug mode as the CUDA probe's sync detector: torch reports every synchronizing
operation it knows of as a warning (`torch.cuda.set_sync_debug_mode("warn")`); gpulab intercepts
those warnings (the user never sees them) and passes each on to `on_sync_reported()`.

Enabling the mode needs CUDA initialised, and gpulab must not initialise it itself (a script
that never uses the GPU must not get a CUDA context, or fork-unsafe DataLoader workers): it is
queued to run when the script's first CUDA call initialises CUDA (torch.cuda._lazy_call), or,
with a torch that has no such queue, enabled at the first step end after CUDA is up.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"


class SyncDebugMode:
    def __init__(self, on_sync_reported: Callable[[], None]):
        self._on_sync_reported = on_sync_reported
        self._installed = False
        self.on = False  # torch's sync debug mode is on (our sync detector)
        self.used = False  # ... and was, at some point of the session
        self._previous_mode = 0
        self._warning_filter = None
        self._original_showwarning = None

    def install(self) -> None:
        self._installed = True
        self._intercept_sync_warnings()
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

    def uninstall(self) -> None:
        self._installed = False
        if self.on and torch.cuda.is_initialized():
            torch.cuda.set_sync_debug_mode(self._previous_mode)
        self.on = False
        if warnings.showwarning is self._showwarning:
            warnings.showwarning = self._original_showwarning
        if self._warning_filter in warnings.filters:
            warnings.filters.remove(self._warning_filter)
            warnings._filters_mutated()

    def _intercept_sync_warnings(self) -> None:
        # "always": Python's default shows a warning once per line, and every sync counts.
        warnings.filterwarnings("always", message=re.escape(SYNC_WARNING))
        self._warning_filter = warnings.filters[0]
        self._original_showwarning = warnings.showwarning
        warnings.showwarning = self._showwarning

    def _showwarning(self, message, category, filename, lineno, file=None, line=None):
        if str(message).startswith(SYNC_WARNING):
            self._on_sync_reported()
            return
        self._original_showwarning(message, category, filename, lineno, file, line)
