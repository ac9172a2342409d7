"""The run directory: its picture, curves.png, a person can read (drawn from hand-made histories), and
the errors of reading a run, worded for whoever reads it."""

from __future__ import annotations

import json
import re
import threading

import matplotlib

matplotlib.use("Agg")
import matplotlib.figure  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from gpulab.errors import UserError  # noqa: E402
from gpulab.train import curves  # noqa: E402
from gpulab.train.rundir import RunDir, claims  # noqa: E402

C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colours: train, test


def row(epoch: int, loss: float, acc: float | None) -> dict:
    return {"epoch": epoch, "train_loss": loss, "train_acc": acc, "test_loss": loss * 1.1,
            "test_acc": None if acc is None else acc - 0.02}


def drawn_figure(tmp_path, history: list[dict], devices: str = "cpu"):
    """write_metrics(history), keeping the figure it saved as curves.png."""
    (tmp_path / "config.json").write_text(json.dumps({"model": "lenet", "devices": devices}))
    drawn = []
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return real_savefig(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", keep)
        RunDir(tmp_path).write_metrics(history)
    (fig,) = drawn
    return fig


def colour_at(fig, ax, x: float, y: float) -> np.ndarray:
    """The rendered colour at data point (x, y) of `ax` (the middle of a 3x3 patch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # the saved figure was closed: draw it again, at the same size
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3].astype(int)
    px, py = ax.transData.transform((x, y))
    r, c = int(round(pixels.shape[0] - py)), int(round(px))
    patch = pixels[r - 1:r + 2, c - 1:c + 2].reshape(-1, 3)
    return patch[np.abs(patch - 255).sum(axis=1).argmax()]  # the least white pixel of the patch


@pytest.mark.parametrize("classifier", [True, False])
def test_a_one_epoch_run_shows_its_point(tmp_path, classifier):
    history = [row(1, 0.9, 0.7 if classifier else None)]
    fig = drawn_figure(tmp_path, history)
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # A line through one point draws nothing there; a marker does (train in C0, test in C1).
    loss_ax = fig.axes[0]
    assert np.abs(colour_at(fig, loss_ax, 1, 0.9) - C0).sum() <= 40
    assert np.abs(colour_at(fig, loss_ax, 1, 0.99) - C1).sum() <= 40
    plt.close("all")


def test_loss_and_accuracy_have_their_own_axes_and_the_run_its_title(tmp_path):
    fig = drawn_figure(tmp_path, [row(1, 0.9, 0.7), row(2, 0.6, 0.8)], devices="cpu*2")
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "accuracy"]
    assert fig._suptitle.get_text() == f"{tmp_path.name}: lenet on cpu*2"
    plt.close("all")


def test_read_errors_name_the_run_as_its_reader_was_given_it(tmp_path):
    """--resume DIR for a resumed run; DIR alone where the folder is named on its own (export)."""
    (tmp_path / "config.json").write_text("[]")
    here = re.escape(str(tmp_path))
    with pytest.raises(UserError, match=f"^--resume {here}: config.json is not a gpulab run config$"):
        RunDir(tmp_path, option="--resume").read_config()
    with pytest.raises(UserError, match=f"^{here}: config.json is not a gpulab run config$"):
        RunDir(tmp_path).read_config()
    # No checkpoint: a resume is told how to start over; a reader, only what is missing.
    with pytest.raises(UserError, match=f"^--resume {here}: no checkpoint.pt there; .*: start it over with gpulab train --out {here}"):
        RunDir(tmp_path, option="--resume").load_checkpoint()
    with pytest.raises(UserError, match=f"^{here}: no checkpoint.pt there; the run stopped before its first epoch ended$"):
        RunDir(tmp_path).check_is_run()
    with pytest.raises(UserError, match=f"^{here}/nope does not exist; give the directory of a gpulab train run$"):
        RunDir(tmp_path / "nope").check_is_run()


def test_a_run_still_in_its_first_epoch_is_said_to_be_so(tmp_path):
    """Not 'the run stopped before its first epoch ended' while it trains (gpulab export RUN too early)."""
    run = tmp_path / "run"
    with claims():
        RunDir(run).claim()  # this process holds the run's lock, as a training process does
        (run / "config.json").write_text("{}")  # written as the run starts
        with pytest.raises(UserError, match=r"no checkpoint.pt there yet; the run is still in its first epoch \(pid "):
            RunDir(run).check_is_run()
    with pytest.raises(UserError, match="the run stopped before its first epoch ended$"):
        RunDir(run).check_is_run()


def test_curves_are_drawn_after_the_last_epoch_and_at_most_every_so_often_before(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model": "lenet", "devices": "cpu"}))
    run_dir = RunDir(tmp_path)
    run_dir.write_metrics([row(1, 0.9, 0.7)], last=False)  # a short run's epoch 1: no picture yet
    run_dir.curves.wait()
    assert (tmp_path / "metrics.json").exists() and not (tmp_path / "curves.png").exists()
    monkeypatch.setattr("gpulab.train.curves.PLOT_EVERY_S", 0.0)  # as if the last picture were old
    run_dir.write_metrics([row(1, 0.9, 0.7), row(2, 0.8, 0.75)], last=False)
    run_dir.curves.wait()
    assert (tmp_path / "curves.png").exists()
    monkeypatch.setattr("gpulab.train.curves.PLOT_EVERY_S", 3600.0)
    (tmp_path / "curves.png").unlink()
    run_dir.write_metrics([row(1, 0.9, 0.7), row(2, 0.8, 0.75), row(3, 0.7, 0.8)], last=True)
    assert (tmp_path / "curves.png").exists()  # the last one is there when write_metrics returns
    plt.close("all")


def test_an_epoch_never_waits_for_a_picture_under_way(tmp_path, monkeypatch):
    """Before the last epoch, curves.png is drawn on a thread of its own: write_metrics returns
    while the drawing is still going; the last epoch's picture waits for it, then is drawn."""
    (tmp_path / "config.json").write_text(json.dumps({"model": "lenet", "devices": "cpu"}))
    run_dir = RunDir(tmp_path)
    release, drawn = threading.Event(), []
    real_draw = curves.draw

    def slow_draw(path, history, title):
        release.wait(timeout=5)
        drawn.append(len(history))
        real_draw(path, history, title)

    monkeypatch.setattr(curves, "draw", slow_draw)
    monkeypatch.setattr(curves, "PLOT_EVERY_S", 0.0)
    run_dir.write_metrics([row(1, 0.9, 0.7)], last=False)
    assert run_dir.curves.drawing.busy() and drawn == []  # returned with the picture under way
    run_dir.write_metrics([row(1, 0.9, 0.7), row(2, 0.8, 0.75)], last=False)  # one at a time: skipped
    release.set()
    run_dir.write_metrics([row(1, 0.9, 0.7), row(2, 0.8, 0.75), row(3, 0.7, 0.8)], last=True)
    assert drawn == [1, 3] and (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob(".*.tmp"))
