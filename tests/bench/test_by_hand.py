"""The script by hand (`gpulab.bench.by_hand`) is the plain-PyTorch contender of `gpulab bench
training`: it must train what `gpulab train` trains by default - the same LeNet, the same
recipe - or the comparison means nothing; and it must report its figures as the textbook's port
does, from a process that imports nothing of gpulab's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from gpulab.bench import by_hand, training
from gpulab.config import RECIPES, TrainConfig
from gpulab.data.loader import FASHION_MEAN, FASHION_STD
from gpulab.devices import native_bf16
from gpulab.models.lenet import LeNet
from gpulab.train.recipe import lr_at


def test_it_trains_gpulab_train_s_default_recipe():
    modern, cfg = RECIPES["modern"], TrainConfig()
    assert cfg.recipe == "modern"
    assert (by_hand.BATCH, by_hand.EVAL_BATCH) == (cfg.batch_size, cfg.eval_batch_size)
    assert (by_hand.PEAK_LR, by_hand.MOMENTUM, by_hand.WEIGHT_DECAY, by_hand.LABEL_SMOOTHING, by_hand.WARMUP_FRAC) == (
        modern.lr, modern.momentum, modern.weight_decay, modern.label_smoothing, modern.warmup_frac)
    assert modern.nesterov and modern.schedule == "onecycle" and modern.normalize and modern.init == "default"
    total = 2340
    assert [by_hand.lr_at(s, total) for s in range(total)] == [lr_at(s, total, modern.lr, modern) for s in range(total)]


def test_it_chooses_bf16_where_gpulab_does():
    assert by_hand.native_bf16(torch.device("cpu")) == native_bf16(torch.device("cpu"))


def test_its_lenet_is_gpulab_s_with_the_same_initial_weights():
    torch.manual_seed(0)
    ours = [p.detach() for p in LeNet().parameters()]
    torch.manual_seed(0)
    theirs = [p.detach() for p in by_hand.lenet().parameters()]
    assert [p.shape for p in theirs] == [p.shape for p in ours]
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours))
    X = torch.randn(4, 1, 28, 28)
    torch.manual_seed(0)
    model = LeNet()
    torch.manual_seed(0)
    assert torch.allclose(by_hand.lenet()(X), model(X), atol=1e-6)


def test_its_data_is_gpulab_s(tiny_data):
    from gpulab import data

    train, test = data.load(tiny_data)
    (X, y), (X_test, y_test) = by_hand.load(tiny_data, torch.device("cpu"))
    assert torch.equal(y, train.labels) and torch.equal(y_test, test.labels)
    # both splits standardised as gpulab train's loader does, with Fashion-MNIST's own statistics
    for images, standardised in ((train.images, X), (test.images, X_test)):
        assert torch.allclose(standardised, (images.float() / 255 - FASHION_MEAN) / FASHION_STD, atol=1e-5)


def test_run_by_its_path_it_learns_and_prints_the_textbook_s_figures(tiny_data):
    """Its own process, 10 epochs (20 steps) on the tiny dataset: one JSON line that `script_figures`
    reads, accuracy far above chance, and not one gpulab module imported."""
    probe = ("import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'gpulab'))")
    out = subprocess.run([sys.executable, "-c", probe, *training.BY_HAND_SCRIPT, "10", "cpu", str(tiny_data)],
                         capture_output=True, text=True, check=True, timeout=300).stdout.strip().splitlines()
    told, imported = json.loads(out[-2]), out[-1]
    assert imported == "[]"
    assert [len(told[k]) for k in ("train_seconds", "eval_seconds", "test_acc", "wall_s")] == [10] * 4
    assert 0 < told["first_step_s"] < told["wall_s"][0] and told["wall_s"] == sorted(told["wall_s"])
    assert told["test_acc"][-1] >= 0.5  # ten classes: chance is 0.1
    ran = training.script_figures(told, wall=told["wall_s"][-1] + 0.1)
    assert ran["epochs"] == 10 and ran["test_acc"] == told["test_acc"][-1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_on_a_gpu_its_recorded_step_trains_as_its_eager_step_does():
    """Three eager steps, then the step recorded once and replayed: the weights after eight steps,
    the learning rate changing at each, are those of eight eager steps."""
    device = torch.device("cuda")
    batches = [(torch.randn(256, 1, 28, 28, device=device), torch.randint(0, 10, (256,), device=device))
               for _ in range(8)]
    weights = []
    for record in (False, True):
        torch.manual_seed(0)
        model = by_hand.lenet().to(device, memory_format=torch.channels_last)
        opt = by_hand.sgd(model, device)
        step = by_hand.Step(model, opt, device, None)
        step.record = record
        for i, (X, y) in enumerate(batches):
            by_hand.set_lr(opt, 0.01 * (i + 1))
            step(X, y)
        assert (step.graph is not None) == record
        weights.append([p.detach().clone() for p in model.parameters()])
    for eager, replayed in zip(*weights):
        torch.testing.assert_close(replayed, eager, rtol=1e-4, atol=1e-5)
