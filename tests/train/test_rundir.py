"""The run directory's picture: curves.png a person can read (drawn from hand-made histories)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gpulab.train.rundir import RunDir

C0, C1 = (0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)  # matplotlib's first two line colours: train, test


def row(epoch: int, loss: float, acc: float | None) -> dict:
    return {"epoch": epoch, "train_loss": loss, "train_acc": acc, "test_loss": loss * 1.1,
            "test_acc": None if acc is None else acc - 0.02}


def pixels_of(png, colour) -> int:
    import matplotlib.image

    rgb = (matplotlib.image.imread(png)[..., :3] * 255).round().astype(int)
    return int((np.abs(rgb - np.array(colour)).sum(axis=-1) <= 30).sum())


@pytest.mark.parametrize("classifier", [True, False])
def test_a_one_epoch_run_shows_its_point(tmp_path, classifier):
    (tmp_path / "config.json").write_text(json.dumps({"model": "lenet", "devices": "cpu"}))
    RunDir(tmp_path).write_metrics([row(1, 0.9, 0.7 if classifier else None)])
    png = tmp_path / "curves.png"
    # A line through one point draws nothing; a marker does (train in C0, test in C1).
    assert pixels_of(png, C0) > 20 and pixels_of(png, C1) > 20


def test_loss_and_accuracy_have_their_own_axes_and_the_run_its_title(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    (tmp_path / "config.json").write_text(json.dumps({"model": "lenet", "devices": "cpu*2"}))
    drawn = []
    real_savefig = matplotlib.figure.Figure.savefig

    def keep(fig, *args, **kwargs):
        drawn.append(fig)
        return real_savefig(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as m:
        m.setattr(matplotlib.figure.Figure, "savefig", keep)
        RunDir(tmp_path).write_metrics([row(1, 0.9, 0.7), row(2, 0.6, 0.8)])
    (fig,) = drawn
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "accuracy"]
    assert fig._suptitle.get_text() == f"{tmp_path.name}: lenet on cpu*2"
    plt.close("all")
