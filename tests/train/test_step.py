"""The training step a reader follows: one definition, and few files from the loop's call to the
optimizer's update (its correctness against plain PyTorch is tests/parallel/test_parity.py's and
test_distributed.py's, which run every strategy through it)."""

import ast
import sys
from pathlib import Path

import torch

from gpulab.train import TrainConfig
from gpulab.train.build import build
from gpulab.train.step import Meter

SRC = Path(__file__).resolve().parents[2] / "src" / "gpulab"


def test_there_is_one_train_step_in_gpulab():
    defined = [f"{path.relative_to(SRC)}:{node.lineno}" for path in SRC.rglob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "train_step"]
    assert [d.split(":")[0] for d in defined] == ["train/step.py"], defined


def files_a_step_runs(step) -> list[str]:
    """gpulab's files whose functions run during `step()`, in the order first entered."""
    files = []

    def note(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and "/src/gpulab/" in path:
            name = path.split("/src/gpulab/")[1]
            if name not in files:
                files.append(name)

    sys.setprofile(note)
    try:
        step()
    finally:
        sys.setprofile(None)
    return files


def test_a_default_step_runs_in_three_files_besides_the_loop_and_the_model(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.rand(64, 1, 28, 28, generator=g), torch.randint(0, 10, (64,), generator=g))
    run = build(TrainConfig(devices="cpu", epochs=1, batch_size=32, out=str(tmp_path / "run")), train_data=data,
                test_data=data)
    X, y = next(iter(run.train_loader))
    meter = Meter(run.devices[0])
    run.trainer.step(X, y, meter)  # the first step also checks the loss's inputs
    files = files_a_step_runs(lambda: run.trainer.step(X, y, meter))
    model = ["models/lenet.py", "models/layers.py"]  # the model's own (its ReLU and pooling's backward)
    assert files == ["train/step.py", "parallel/data_parallel.py", "parallel/allreduce.py", *model]
    assert meter.count == 64  # and the steps did run
