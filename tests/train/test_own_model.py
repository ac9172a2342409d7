"""Your own nn.Module, loss and optimizer through gpulab's strategies (issue 10, part 1).

Correctness is checked against plain PyTorch: one model, `loss.backward(); opt.step()` on the
whole batch, no gpulab code in the reference.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpulab.cli import main
from gpulab.errors import UserError
from gpulab.train import TrainConfig, build, train


def regression_data(n: int = 256, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """y = x @ w + noise: 8 features, 2 targets - neither images nor classes."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, 8, generator=g)
    y = X @ torch.randn(8, 2, generator=g) + 0.01 * torch.randn(n, 2, generator=g)
    return TensorDataset(X[: n * 3 // 4], y[: n * 3 // 4]), TensorDataset(X[n * 3 // 4:], y[n * 3 // 4:])


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))


def config(tmp_path: Path, **overrides) -> TrainConfig:
    args = dict(devices="cpu", epochs=1, batch_size=32, precision="fp32", out=str(tmp_path / "run"))
    args.update(overrides)
    return TrainConfig(**args)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


@pytest.mark.parametrize("devices", ["cpu", "cpu*2", "cpu*3"])
def test_one_step_of_your_model_loss_and_optimizer_equals_plain_pytorch(tmp_path, devices):
    train_set, test_set = regression_data()
    X, y = train_set.tensors[0][:48], train_set.tensors[1][:48]
    reference = mlp()
    ours = copy.deepcopy(reference)
    opt = adam(reference.parameters())
    nn.functional.mse_loss(reference(X), y).backward()  # plain PyTorch: one model, the whole batch
    opt.step()

    run = build(config(tmp_path, devices=devices), train_data=train_set, test_data=test_set, model=ours,
                loss_fn=nn.MSELoss(), optimizer=adam)
    run.trainer.train_step(X, y)
    for got, want in zip(run.strategy.state_dict()["model"].values(), reference.state_dict().values()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_regression_model_trains_on_cpu_and_cpu2_alike_with_loss_only(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAB_DATA", str(tmp_path / "nowhere"))  # no Fashion-MNIST involved
    train_set, test_set = regression_data()
    rows = {}
    for devices in ("cpu", "cpu*2"):
        rows[devices] = train(config(tmp_path / devices, devices=devices, epochs=3), train_data=train_set,
                              test_data=test_set, model=mlp(), loss_fn=nn.MSELoss(), optimizer=adam)
    assert rows["cpu"]["train_acc"] is None and rows["cpu"]["test_acc"] is None  # not a classifier
    assert rows["cpu"]["test_loss"] < 0.5 * regression_baseline(test_set)  # it learned
    assert rows["cpu*2"]["train_loss"] == pytest.approx(rows["cpu"]["train_loss"], rel=1e-5)
    saved = json.loads((tmp_path / "cpu" / "run" / "config.json").read_text())
    assert (saved["model"], saved["data"], saved["input_shape"]) == ("custom", "custom", [8])
    checkpoint = torch.load(tmp_path / "cpu" / "run" / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["strategy"]["optimizer"]["param_groups"][0]["lr"] == 1e-2  # your optimizer keeps its lr


def regression_baseline(test_set: TensorDataset) -> float:
    """The test MSE of always predicting zero."""
    return float(test_set.tensors[1].pow(2).mean())


def test_resuming_a_run_of_a_model_object_asks_for_the_object(tmp_path):
    train_set, test_set = regression_data()
    train(config(tmp_path), train_data=train_set, test_data=test_set, model=mlp(), loss_fn=nn.MSELoss())
    with pytest.raises(UserError, match=r"passed to gpulab.train.train\(\) as an object, so it cannot be rebuilt from the run directory: pass it again"):
        train(resume=str(tmp_path / "run"), train_data=train_set, test_data=test_set)


class SumOverBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 2)

    def forward(self, x):
        return self.linear(x).sum(0, keepdim=True)  # (1, 2) whatever the batch


@pytest.mark.parametrize(("model", "loss_fn", "message"), [
    (mlp, lambda: nn.MSELoss(reduction="none"), r"the loss returned \(16, 2\), not one number: .*reduction='mean'"),
    (SumOverBatch, nn.MSELoss, r"outputs have batch size 1 \(shape \(1, 2\)\) but the labels have 16"),
])
def test_a_loss_that_does_not_reduce_or_outputs_without_the_batch_are_one_line_errors(tmp_path, model, loss_fn, message):
    train_set, test_set = regression_data()
    with pytest.raises(UserError, match=message):
        train(config(tmp_path, batch_size=16), train_data=train_set, test_data=test_set, model=model(), loss_fn=loss_fn())


@pytest.mark.parametrize("devices", ["cpu", "cpu*2"])
def test_your_model_object_ends_trained_as_plain_pytorch_leaves_it(tmp_path, devices):
    """train(model=m) trained copies and left m as it was (the weights only in checkpoint.pt): m
    now ends with the weights the run trained, as plain PyTorch's loop leaves its model."""
    train_set, test_set = regression_data()
    ours = mlp()
    before = copy.deepcopy(ours.state_dict())
    train(config(tmp_path, devices=devices), train_data=train_set, test_data=test_set, model=ours,
          loss_fn=nn.MSELoss(), optimizer=adam)
    trained = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["strategy"]["model"]
    for name, value in ours.state_dict().items():
        torch.testing.assert_close(value, trained[name], rtol=0, atol=0)
        assert not torch.equal(value, before[name])


@pytest.mark.parametrize("optimizer, message", [
    (lambda model: torch.optim.SGD(model.parameters(), lr=0.1), "not a SGD already built on the model's parameters"),
    (lambda model: (lambda params: None), "the optimizer factory returned NoneType, not a torch.optim.Optimizer"),
    (lambda model: "adam", "not a str"),
])
def test_an_optimizer_that_is_no_factory_is_one_line(tmp_path, optimizer, message):
    """An optimizer instance was a traceback ('SGD' object is not callable); a factory returning None
    failed at the first step, the run's folder written."""
    train_set, test_set = regression_data()
    model = mlp()
    with pytest.raises(UserError, match=re.escape(message)):
        train(config(tmp_path), train_data=train_set, test_data=test_set, model=model, loss_fn=nn.MSELoss(),
              optimizer=optimizer(model))
    assert not (tmp_path / "run").exists()


def test_a_dataloader_whose_last_batch_cannot_be_split_is_refused_before_training(tmp_path):
    """129 samples in batches of 64 over 2 devices: the last batch of 1 failed after 2 steps, saying
    'use a batch size >= 2' where it was 64."""
    train_set, test_set = regression_data()
    X, y = train_set.tensors
    loader = torch.utils.data.DataLoader(TensorDataset(X[:129], y[:129]), batch_size=64)
    with pytest.raises(UserError, match=re.escape("train_data's last batch holds 1 sample(s) (129 in batches of 64), "
                                                  "fewer than the 2 parts") + ".*drop_last=True"):
        train(config(tmp_path, devices="cpu*2"), train_data=loader, test_data=test_set, model=mlp(), loss_fn=nn.MSELoss())
    assert not (tmp_path / "run").exists()
    dropped = torch.utils.data.DataLoader(TensorDataset(X[:129], y[:129]), batch_size=64, drop_last=True)
    assert train(config(tmp_path, devices="cpu*2"), train_data=dropped, test_data=test_set, model=mlp(),
                 loss_fn=nn.MSELoss())["epoch"] == 1


class Fields(torch.utils.data.Dataset):
    def __init__(self, kind: str):
        self.kind = kind

    def __len__(self):
        return 64

    def __getitem__(self, i):
        x, y = torch.randn(8), torch.randn(2)
        return {"dict": {"x": x, "y": y}, "triple": (x, y, i), "alone": x}[self.kind]


@pytest.mark.parametrize("kind, words", [("dict", "a dict with keys x, y"), ("triple", "a tuple of 3"),
                                         ("alone", "a Tensor")])
def test_samples_that_are_no_input_label_pair_are_one_line(tmp_path, kind, words):
    """A Dataset of dicts was a KeyError traceback, one of triples 'too many values to unpack'."""
    _, test_set = regression_data()
    with pytest.raises(UserError, match=re.escape(words) + ".*return \\(x, y\\)"):
        train(config(tmp_path), train_data=Fields(kind), test_data=test_set, model=mlp(), loss_fn=nn.MSELoss())
    assert not (tmp_path / "run").exists()


def test_a_model_with_nothing_to_train_is_refused(tmp_path):
    train_set, test_set = regression_data()
    frozen = mlp().requires_grad_(False)
    with pytest.raises(UserError, match=r"the model passed to train\(\) has no parameter that requires a gradient"):
        train(config(tmp_path), train_data=train_set, test_data=test_set, model=frozen, loss_fn=nn.MSELoss())
    assert not (tmp_path / "run").exists()


def test_a_model_spanning_devices_is_refused(tmp_path):
    train_set, test_set = regression_data()
    model = mlp()
    model[2] = nn.Linear(32, 2, device="meta")
    with pytest.raises(UserError, match=r"parameters are on several devices \(cpu, meta\)"):
        train(config(tmp_path), train_data=train_set, test_data=test_set, model=model, loss_fn=nn.MSELoss())


@pytest.fixture
def model_module(tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(textwrap.dedent("""
        from torch import nn

        def small_mlp():
            return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Linear(32, 10))

        def not_a_model():
            return 42

        def no_parameters():
            return nn.Flatten()

        def needs_a_size(width):
            return nn.Linear(784, width)
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)


def test_cli_trains_your_model_from_a_factory(tiny_data, tmp_path, model_module):
    out = tmp_path / "run"
    assert main(["train", "--model", f"{model_module}:small_mlp", "--devices", "cpu*2", "--epochs", "1",
                 "--batch-size", "64", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["model"] == "my_models:small_mlp" and saved["input_shape"] == [1, 28, 28]
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["strategy"]["model"]
    assert set(state) == {"1.weight", "1.bias", "3.weight", "3.bias"}  # the factory's model, not LeNet


@pytest.mark.parametrize(("spec", "message"), [
    ("my_models:nope", "my_models has no callable nope"),
    ("my_models:not_a_model", "not_a_model\\(\\) returned an object of type int, not a torch.nn.Module"),
    ("my_models:no_parameters", "the model no_parameters\\(\\) built has no parameter that requires a gradient: "
                                "nothing to train"),
    ("my_models:needs_a_size", "needs_a_size\\(\\) cannot be called without arguments \\(missing a required "
                               "argument: 'width'\\)"),
    ("no_such_module:f", "cannot import no_such_module"),
    ("alexnet", "unknown model; choose one of lenet, resnet18, or give your own as package.module:factory"),
])
def test_cli_bad_model_specs_are_one_line_errors(tmp_path, model_module, capsys, spec, message):
    assert main(["train", "--model", spec, "--epochs", "1", "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert re.search(message, err)


def test_your_model_from_a_factory_trains_on_two_torchrun_ranks(tiny_data, tmp_path, model_module):
    # Each rank builds the model from the factory; rank 0's weights are broadcast (gpulab launch).
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPULAB_DATA": str(tiny_data),
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{Path(__file__).resolve().parents[2] / 'src'}"}
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "gpulab", "launch", "-n", "2", "--", "--model", f"{model_module}:small_mlp",
         "--epochs", "1", "--batch-size", "32", "--precision", "fp32", "--out", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "training my_models:small_mlp on 2 ranks" in done.stdout
    state = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)["strategy"]["model"]
    assert set(state) == {"1.weight", "1.bias", "3.weight", "3.bias"}


def test_labels_the_model_cannot_score_are_a_one_line_error(tmp_path):
    # 12 classes of labels for the built-in LeNet's 10 outputs: an IndexError inside cross_entropy before.
    images = torch.randn(64, 1, 28, 28)
    labels = torch.arange(64) % 12
    data = TensorDataset(images, labels)
    with pytest.raises(UserError, match=r"labels run from 0 to 11, but the model gives 10 class scores"):
        train(config(tmp_path), train_data=data, test_data=data)
