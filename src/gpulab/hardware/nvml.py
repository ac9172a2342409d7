"""NVML (nvidia-ml-py) as all of gpulab reads it: starting it, and one funnel, `Queries.query`,
that every NVML query goes through, with one error policy. The queries themselves are written in
nvml_gpus.py, the one reader of the GPUs. Torch-free: the profiler's parent process samples the
GPUs without torch.

The policy (after nvitop's `nvmlQuery`): a query that fails is n/a (None), never a traceback.
- unsupported: NOT_SUPPORTED, FUNCTION_NOT_FOUND, or an nvidia-ml-py too old to have the function.
  The GPU or driver lacks it: n/a, never asked again, and not a problem.
- no permission: n/a and never asked again (asking again will not grant it); a problem to say.
- not found: there is nothing to give (an empty MIG slot, no process sample since the last one):
  the caller's `none_found`, not a problem.
- any other NVML error (GPU lost, unknown error, timeout): n/a this time; a problem to say.
- an exception that is not NVML's is a bug in gpulab: it is raised, traceback and all.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

UNSUPPORTED = "unsupported"
NO_PERMISSION = "no permission"
NOT_FOUND = "not found"
FAILED = "failed"

# ----------------------------------------------------------------------------- starting


def start_nvml() -> tuple[Any, str, str]:
    """(pynvml, "", "") with NVML started, or (None, kind, why) when it cannot start: the one place
    that starts NVML, for `gpulab devices` and the profiler's sampler. Stop it with `stop_nvml`."""
    try:
        import pynvml
    except ImportError:
        return None, "not_installed", "nvidia-ml-py is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVML raises its own error types, one per cause
        return None, *init_failure(pynvml, e)
    return pynvml, "", ""


def init_failure(nv, error: Exception) -> tuple[str, str]:
    code = getattr(error, "value", None)
    if code == getattr(nv, "NVML_ERROR_LIBRARY_NOT_FOUND", None):
        return "no_driver", (
            "NVML library libnvidia-ml.so.1 not found: no NVIDIA driver here (or not mounted into this container)"
        )
    if code == getattr(nv, "NVML_ERROR_DRIVER_NOT_LOADED", None):
        return "no_driver", "the NVIDIA kernel driver is not loaded"
    if code == getattr(nv, "NVML_ERROR_NO_PERMISSION", None):
        return "no_permission", f"permission denied starting NVML ({error})"
    return "error", f"NVML failed to start: {error}"


def stop_nvml(nv) -> None:
    try:
        nv.nvmlShutdown()
    except Exception:
        pass  # nothing to undo when shutting down fails


# ----------------------------------------------------------------------------- the one funnel


def failure_kind(nv, error: Exception) -> str:
    """The one error policy: what a failed query's `error` means (see the module's docstring).
    Re-raises an error that is not NVML's: that is a bug, not a GPU problem."""
    if isinstance(error, AttributeError) and error.obj is nv:
        return UNSUPPORTED  # this nvidia-ml-py lacks the function (or its constant)
    if not (isinstance(error, nv.NVMLError) and isinstance(getattr(error, "value", None), int)):
        raise error
    if error.value in (nv.NVML_ERROR_NOT_SUPPORTED, getattr(nv, "NVML_ERROR_FUNCTION_NOT_FOUND", None)):
        return UNSUPPORTED
    if error.value == nv.NVML_ERROR_NO_PERMISSION:
        return NO_PERMISSION
    if error.value == nv.NVML_ERROR_NOT_FOUND:
        return NOT_FOUND
    return FAILED


def error_text(error: Exception) -> str:
    return f"NVML error: {error}"


class Queries:
    """The NVML queries about one GPU (or about the driver): each goes through `query`, which
    applies the policy and remembers what it learned."""

    def __init__(self, nv):
        self.nv = nv
        self.unsupported: set[str] = set()  # what is never asked again
        self.problems: dict[str, str] = {}  # what failed -> its first failure's text, in order

    @property
    def problem(self) -> str | None:
        """The first problem: later ones mostly share its cause (a lost GPU fails every query)."""
        return next(iter(self.problems.values()), None)

    def query(self, what: str, read: Callable[[], T], none_found: Any = None) -> T | None:
        """`read()`, or None when it fails (`none_found` when NVML says there is nothing to give).

        `what` names the query for the policy's memory; `read` calls NVML (one call, or a few
        that make one reading), looking the functions up on the module itself so that a
        function this nvidia-ml-py lacks counts as unsupported.
        """
        if what in self.unsupported:
            return None
        try:
            return read()
        except Exception as error:  # failure_kind re-raises what is not NVML's
            kind, text = failure_kind(self.nv, error), error_text(error)
        if kind in (UNSUPPORTED, NO_PERMISSION):
            self.unsupported.add(what)
        if kind in (NO_PERMISSION, FAILED):
            self.problems.setdefault(what, text)
        return none_found if kind == NOT_FOUND else None

