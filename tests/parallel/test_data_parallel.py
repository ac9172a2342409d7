import pytest
import torch
from torch import nn

from gpulab.devices import resolve
from gpulab.errors import UserError
from gpulab.models import LeNet
from gpulab.parallel import DataParallel, replicate, split_batch
from gpulab.train.step import Meter, Trainer

CPU = torch.device("cpu")


def test_replicate_module_gives_independent_copies_on_the_same_device():
    model = nn.Linear(3, 2)
    a, b = replicate(model, resolve("cpu*2"))
    with torch.no_grad():
        a.weight.fill_(1.0)
    assert not torch.equal(a.weight, b.weight)
    assert not torch.equal(model.weight, a.weight)
    assert a.weight.requires_grad and b.weight.requires_grad


def test_replicate_params_like_the_chapter():
    params = [torch.randn(4, 4), torch.zeros(4)]
    copies = replicate(params, resolve("cpu*3"))
    assert len(copies) == 3
    for copy in copies:
        for p, q in zip(copy, params):
            assert torch.equal(p, q) and p.requires_grad and p.is_leaf
            assert p.data_ptr() != q.data_ptr()


@pytest.mark.parametrize("n,k", [(8, 2), (10, 3), (5, 5), (7, 4)])
def test_split_batch_sizes_and_contents(n, k):
    X, y = torch.arange(n * 2).view(n, 2), torch.arange(n)
    Xs, ys = split_batch(X, y, resolve(f"cpu*{k}"))
    sizes = [len(s) for s in ys]
    assert len(Xs) == k and sum(sizes) == n and max(sizes) - min(sizes) <= 1
    assert torch.equal(torch.cat(Xs), X) and torch.equal(torch.cat(ys), y)


def test_split_batch_bad_input():
    with pytest.raises(UserError, match="cannot be split over 4 devices"):
        split_batch(torch.zeros(3, 2), torch.zeros(3), resolve("cpu*4"))
    with pytest.raises(UserError, match="X has 3 samples but y has 2"):
        split_batch(torch.zeros(3, 2), torch.zeros(2), resolve("cpu*2"))


def test_module_on_several_devices_is_refused():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(UserError, match="several devices"):
        replicate(model, [CPU])


def test_replicas_stay_identical_and_loss_is_the_batch_mean():
    torch.manual_seed(0)
    model = LeNet()
    X, y = torch.randn(11, 1, 28, 28), torch.randint(0, 10, (11,))
    dp = DataParallel(model, resolve("cpu*3"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with torch.no_grad():
        expected = nn.functional.cross_entropy(model(X), y)
    meter = Meter(CPU)
    trainer = Trainer(dp, nn.functional.cross_entropy)
    loss = trainer.train_step(X, y, meter)
    torch.testing.assert_close(loss, expected)
    for r in dp.replicas[1:]:
        for p, q in zip(r.parameters(), dp.module.parameters()):
            assert torch.equal(p, q)
    stats = trainer.read(meter)
    assert stats["count"] == 11 and 0 <= stats["accuracy"] <= 1
    torch.testing.assert_close(stats["loss"], expected.item())


def test_evaluate_spreads_over_devices_and_counts_every_sample():
    torch.manual_seed(0)
    model = LeNet()
    X, y = torch.randn(50, 1, 28, 28), torch.randint(0, 10, (50,))
    batches = [(X[i : i + 16], y[i : i + 16]) for i in range(0, 50, 16)]  # last batch of 2 < k
    single = Trainer(DataParallel(model, [CPU]), nn.functional.cross_entropy).evaluate(batches)
    multi = Trainer(DataParallel(model, resolve("cpu*3")), nn.functional.cross_entropy).evaluate(batches)
    with torch.no_grad():
        expected = (model(X).argmax(1) == y).float().mean().item()
    assert single["count"] == multi["count"] == 50
    assert single["accuracy"] == pytest.approx(expected) and multi["accuracy"] == pytest.approx(expected)


def test_per_device_batchnorm_buffers_are_averaged_for_evaluation():
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 26 * 26, 10))
    dp = DataParallel(model, resolve("cpu*2"))
    X = torch.cat([torch.randn(4, 1, 28, 28), torch.randn(4, 1, 28, 28) + 5])  # shards see different stats
    Trainer(dp, nn.functional.cross_entropy).train_step(X, torch.randint(0, 10, (8,)))
    a, b = (r[1].running_mean.clone() for r in dp.replicas)
    assert not torch.allclose(a, b)
    dp.sync_buffers()
    torch.testing.assert_close(dp.replicas[0][1].running_mean, (a + b) / 2)
    torch.testing.assert_close(dp.replicas[1][1].running_mean, (a + b) / 2)


def test_state_dict_round_trip_into_more_devices():
    torch.manual_seed(0)
    src = DataParallel(LeNet(), [CPU], optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    Trainer(src, nn.functional.cross_entropy).train_step(torch.randn(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    dst = DataParallel(LeNet(), resolve("cpu*2"), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
    dst.load_state_dict(src.state_dict())
    for r in dst.replicas:
        for p, q in zip(r.parameters(), src.module.parameters()):
            assert torch.equal(p, q)


def test_bf16_autocast_keeps_fp32_master_weights_and_close_loss():
    torch.manual_seed(0)
    model = LeNet()
    X, y = torch.randn(16, 1, 28, 28), torch.randint(0, 10, (16,))
    fp32 = DataParallel(model, resolve("cpu*2"))
    bf16 = DataParallel(model, resolve("cpu*2"))
    loss32 = Trainer(fp32, nn.functional.cross_entropy).train_step(X, y)
    loss16 = Trainer(bf16, nn.functional.cross_entropy, autocast=torch.bfloat16).train_step(X, y)
    assert loss16.dtype == torch.float32  # autocast computes the loss in fp32
    assert abs(loss16.item() - loss32.item()) < 0.05
    assert all(p.dtype == torch.float32 for p in bf16.module.parameters())
    for p, q in zip(bf16.replicas[0].parameters(), bf16.replicas[1].parameters()):
        assert torch.equal(p, q)  # replicas stay identical in mixed precision too
    assert Trainer(bf16, nn.functional.cross_entropy, autocast=torch.bfloat16).evaluate([(X, y)])["count"] == 16


def test_bf16_evaluation_loss_is_computed_in_fp32():
    torch.manual_seed(0)
    model = LeNet()
    X, y = torch.randn(64, 1, 28, 28), torch.randint(0, 10, (64,))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = nn.functional.cross_entropy(model(X), y).item()  # autocast: loss in fp32
    trainer = Trainer(DataParallel(model, resolve("cpu*2")), nn.functional.cross_entropy, autocast=torch.bfloat16)
    got = trainer.evaluate([(X, y)], nn.functional.cross_entropy)
    assert got["loss"] == pytest.approx(expected, abs=1e-4)
