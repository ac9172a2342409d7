"""The categories a step's memory is split into, their names in words, and sizes in words:
torch-free, for the profiler's analysis and the planner alike."""

from __future__ import annotations

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "inputs", "other_kept", "temporaries")
"""What the model is, what backward adds, what the optimizer keeps, what forward saves for
backward, the batch, and the rest - memory kept across steps that none of those explain (a
dataset held in memory) and the step's temporaries."""

CATEGORY_NAMES = {
    "parameters": "parameters", "gradients": "gradients", "optimizer_state": "optimizer state",
    "activations": "activations", "inputs": "inputs", "other_kept": "other kept", "temporaries": "temporaries",
    "other": "other",
}


def size(nbytes: float | None) -> str:
    """1536 -> '1.5 KiB'; bytes in binary units, as torch and nvidia-smi print memory."""
    if nbytes is None:
        return "?"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
