"""Starting NVML (nvidia-ml-py): the one place that does, for `gpulab devices` (install_check)
and the profiler's sampler. Torch-free: the profiler's parent process starts it without torch."""

from __future__ import annotations

from typing import Any


def start_nvml() -> tuple[Any, str, str]:
    """(pynvml, "", "") with NVML started, or (None, kind, why) when it cannot start: the one place
    that starts NVML, for `gpulab devices` and the profiler's sampler. The caller shuts it down."""
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
