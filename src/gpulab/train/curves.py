"""curves.png: a run's loss and accuracy by epoch, drawn where no epoch waits for it.

Drawing the picture takes a few tenths of a second and importing matplotlib about a second:
more than a small model's epoch on a GPU. So during a run the picture is redrawn at most every
PLOT_EVERY_S, on a thread of its own, while the next epoch trains; after the last epoch it is
drawn once more and the run waits for that one (the picture is part of its result). While a GPU
trains, the host's cores are free: there matplotlib is imported on that thread as the run starts
(`prepare`), so the last picture costs only its drawing. On a CPU the cores are the training's,
and the import waits until a picture is due.

The figure is matplotlib's object API (a Figure of its own, no pyplot state), which a thread may
draw while the main thread trains.
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from pathlib import Path

from gpulab.io import atomic_write_bytes
from gpulab.train.background import Background

PLOT_EVERY_S = 30.0  # curves.png at most this often during a run, and always after its last epoch


def import_matplotlib() -> None:
    import matplotlib.figure

    del matplotlib  # the import is the work


class Curves:
    """curves.png in `folder`, titled by `title()` (read when drawn)."""

    def __init__(self, folder: Path, title: Callable[[], str]):
        self.folder, self.title = folder, title
        self.drawn_at = time.monotonic()  # the run's first picture after PLOT_EVERY_S
        self.drawing = Background("gpulab-curves")

    def prepare(self) -> None:
        """Import matplotlib on a thread of its own now (the host's cores are free)."""
        if not self.drawing.busy():
            self.wait()
            self.drawing.start(import_matplotlib)

    def update(self, history: list[dict], last: bool) -> None:
        """Draw `history` now and wait for it when `last`; else on the thread, if the picture is
        PLOT_EVERY_S old and no drawing is under way."""
        if last:
            self.wait()
            draw(self.folder / "curves.png", history, self.title())
            self.drawn_at = time.monotonic()
        elif time.monotonic() - self.drawn_at >= PLOT_EVERY_S and not self.drawing.busy():
            self.wait()
            rows, title = [dict(r) for r in history], self.title()
            self.drawing.start(lambda: draw(self.folder / "curves.png", rows, title))
            self.drawn_at = time.monotonic()

    def wait(self) -> None:
        """The thread's work finished; a bug in it raised here. A picture it could not write (a
        full disk) is left to the last one, drawn in the caller's thread, to report."""
        failure = self.drawing.wait()
        if failure is not None and not isinstance(failure, OSError):
            raise failure


def draw(path: Path, history: list[dict], title: str) -> None:
    """Loss and accuracy by epoch, each on its own axes, every epoch a marker (so that a 1-epoch
    run shows its point), titled with the run; written atomically."""
    from matplotlib.figure import Figure

    epochs = [r["epoch"] for r in history]
    classifier = history[-1].get("train_acc") is not None
    fig = Figure(figsize=(9 if classifier else 5.5, 3.6), dpi=120)
    axes = fig.subplots(1, 2 if classifier else 1, squeeze=False)
    panels = [(axes[0][0], "loss", [("train_loss", "train"), ("test_loss", "test")])]
    if classifier:
        panels.append((axes[0][1], "accuracy", [("train_acc", "train"), ("test_acc", "test")]))
    for ax, name, series in panels:
        for key, label in series:
            values = [r.get(key) for r in history]
            if any(v is not None for v in values):
                ax.plot(epochs, values, "o-" if label == "train" else "s--", label=label)
        ax.set_xlabel("epoch")
        ax.set_ylabel(name)
        ax.set_xlim(0.5, max(epochs[-1], 2) + 0.5)
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, parse_math=False)  # a folder named run$x$ is a name, not mathtext
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())
