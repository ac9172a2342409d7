"""The whole step recorded as a CUDA graph (parallel/graphed.py): what a CPU can check - the
warm-up's state put back so the recorded run trains the model eager training would, against plain
PyTorch - and, on a GPU, training through the replayed graph against plain PyTorch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gpulab.errors import UserError
from gpulab.models import build
from gpulab.parallel.data_parallel import DataParallel
from gpulab.parallel.graphed import check_capturable, graph_lr, restore, snapshot
from gpulab.train.step import Meter, Trainer


def sgd(params, fused=True, **kw):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4, fused=fused, **kw)


def steps(model, opt, batches):
    for X, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 1, 28, 28, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(n)]


def test_state_put_back_after_warm_up_trains_as_a_fresh_model_and_optimizer():
    torch.manual_seed(0)
    model = build("lenet")
    fresh = build("lenet")
    fresh.load_state_dict(model.state_dict())
    opt, fresh_opt = sgd(model.parameters()), sgd(fresh.parameters(), fused=False)
    saved = snapshot([model], [opt])
    steps(model, opt, batches(3, seed=1))  # the warm-up: moves the weights, creates momentum
    restore(saved, [opt])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    # the momentum the warm-up created is zero: the next steps are an optimizer's first ones
    # (fused, and no longer on its first-step branch) - as plain PyTorch's, from scratch
    steps(model, opt, batches(3))
    steps(fresh, fresh_opt, batches(3))
    for a, b in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_state_loaded_before_recording_is_put_back_not_zeroed():
    torch.manual_seed(0)
    model = build("lenet")
    opt = sgd(model.parameters())
    steps(model, opt, batches(2, seed=2))  # a resumed run: momentum already there
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    saved = snapshot([model], [opt])
    steps(model, opt, batches(3, seed=1))
    restore(saved, [opt])
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))


def test_an_optimizer_a_graph_cannot_record_is_refused_with_the_fix():
    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(UserError, match="fused=True"):
        check_capturable([torch.optim.SGD(params, lr=0.1, momentum=0.9)])
    with pytest.raises(UserError, match="dampening"):
        check_capturable([torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1, fused=True)])
    check_capturable([torch.optim.Adam(params, lr=0.1, capturable=True)])


def test_the_learning_rate_a_graph_applies_is_float32():
    assert graph_lr(0.1) == float(torch.tensor(0.1, dtype=torch.float32)) != 0.1
    assert graph_lr(0.5) == 0.5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("compile", ["record", "graphs"])  # the eager step recorded; the compiled one
def test_replayed_step_trains_as_plain_pytorch_and_follows_the_learning_rate(compile):
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = build("lenet").double()
    reference = build("lenet").double().to(device)
    reference.load_state_dict(model.state_dict())
    strategy = DataParallel(model, [device], optimizer=lambda p: sgd(p))
    trainer = Trainer(strategy, nn.functional.cross_entropy, compile=compile)
    meter = Meter(device)
    ref_opt = sgd(reference.parameters(), fused=False)
    lrs = [0.5, 0.25, 0.125, 0.0625, 0.5]  # exact in float32: the graph's lr is the reference's
    for lr, (X, y) in zip(lrs, batches(5)):
        X, y = X.double().to(device), y.to(device)
        trainer.set_lr(lr)
        meter.totals.zero_()
        trainer.step(X, y, meter)
        loss = meter.totals[0] / len(y)
        for group in ref_opt.param_groups:
            group["lr"] = lr
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(reference(X), y)
        ref_loss.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-9, atol=1e-12)
    assert trainer.graph is not None and trainer.graph.graph is not None  # replayed, not eager
    for a, b in zip(strategy.module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_a_recorded_step_under_bf16_autocast_trains_as_plain_pytorch_does():
    """What `gpulab train` runs by default on one bf16 GPU: the eager step recorded under autocast
    (whose cache of cast weights is off while the graph records) - as plain PyTorch under the same
    autocast, to bf16's precision."""
    torch.manual_seed(0)
    device = torch.device("cuda")
    model = build("lenet")
    reference = build("lenet").to(device)
    reference.load_state_dict(model.state_dict())
    strategy = DataParallel(model, [device], optimizer=lambda p: sgd(p))
    trainer = Trainer(strategy, nn.functional.cross_entropy, autocast=torch.bfloat16, compile="record")
    ref_opt = sgd(reference.parameters(), fused=False)
    for X, y in batches(5):
        X, y = X.to(device), y.to(device)
        trainer.step(X, y)
        ref_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            nn.functional.cross_entropy(reference(X), y).backward()
        ref_opt.step()
    assert trainer.graph.graph is not None
    for a, b in zip(strategy.module.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
