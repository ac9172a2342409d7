"""K torchrun ranks (gloo on loopback) compute what plain PyTorch computes on one model.

dist_worker.py trains each case with gpulab's `Distributed` strategy, every rank on its part of
each global batch; the reference here is plain PyTorch on the whole batches, with nothing of
gpulab in it. float64, so any difference above rounding is a wrong algorithm.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gpulab.data import GlobalBatches
from gpulab.parallel.allreduce import Buckets
from gpulab.parallel.distributed import GradSync

WORKER_PATH = Path(__file__).with_name("dist_worker.py")
_spec = importlib.util.spec_from_file_location("dist_worker", WORKER_PATH)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

SMALL_BUCKETS = dict(bucket_bytes=1024, first_bucket_bytes=256)  # several buckets: launches overlap backward
CASES = [
    dict(name="sgd-gpulab", model="convnet", optimizer="sgd", sync="gpulab", batch_size=24, steps=4, **SMALL_BUCKETS),
    dict(name="adam-gpulab-uneven", model="convnet", optimizer="adam", sync="gpulab", batch_size=23, steps=4),
    dict(name="sgd-ddp", model="convnet", optimizer="sgd", sync="ddp", batch_size=24, steps=4),
    dict(name="adam-ddp-uneven", model="convnet", optimizer="adam", sync="ddp", batch_size=23, steps=4),
    dict(name="accumulate-gpulab", model="convnet", optimizer="sgd", sync="gpulab", batch_size=24, steps=3,
         accumulate=3, **SMALL_BUCKETS),
    dict(name="accumulate-ddp", model="convnet", optimizer="sgd", sync="ddp", batch_size=23, steps=3, accumulate=2),
    dict(name="unused-sgd", model="branchy", optimizer="sgd", sync="gpulab", batch_size=12, steps=8,
         bucket_bytes=64, first_bucket_bytes=64),
    dict(name="unused-adam", model="branchy", optimizer="adam", sync="gpulab", batch_size=12, steps=8),
    dict(name="frozen", model="frozen", optimizer="sgd", sync="gpulab", batch_size=24, steps=3, **SMALL_BUCKETS),
    # Plain PyTorch normalizes over the whole batch: across ranks that is sync BN.
    dict(name="sync-bn", model="bnnet", optimizer="sgd", sync="gpulab", batch_size=23, steps=4, sync_bn=True, **SMALL_BUCKETS),
    # Sharded (FSDP2): each rank holds 1/k of parameters, gradients and optimizer state.
    dict(name="sgd-fsdp", model="convnet", optimizer="sgd", shard="fsdp", batch_size=24, steps=4),
    dict(name="adam-fsdp-uneven", model="convnet", optimizer="adam", shard="fsdp", batch_size=23, steps=4),
    dict(name="accumulate-fsdp", model="convnet", optimizer="sgd", shard="fsdp", batch_size=23, steps=3, accumulate=2),
]


def reference(case: dict) -> dict[str, torch.Tensor]:
    """Plain PyTorch: one model, one optimizer step per global batch."""
    model = worker.make_model(case["model"])
    opt = worker.OPTIMIZERS[case["optimizer"]](model.parameters())
    for X, y in worker.make_batches(case["model"], case["batch_size"], case["steps"]):
        opt.zero_grad()
        nn.functional.cross_entropy(model(X), y).backward()
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module", params=[2, 3], ids=lambda k: f"{k}ranks")
def trained(request, tmp_path_factory):
    k = request.param
    out = tmp_path_factory.mktemp(f"ranks{k}")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(k), str(WORKER_PATH),
         json.dumps(CASES), str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return k, out


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_k_ranks_equal_plain_pytorch(trained, case):
    k, out = trained
    expected = reference(case)
    ranks = [torch.load(out / f"{case['name']}-rank{r}.pt") for r in range(k)]
    for name, want in expected.items():
        if name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            continue  # buffers: each rank keeps its own running statistics (averaged at evaluation)
        diff = (ranks[0][name] - want).abs().max().item()
        assert diff <= 1e-9, f"{name}: {diff:.3e} from plain PyTorch"
        for r in range(1, k):
            assert torch.equal(ranks[r][name], ranks[0][name]), f"rank {r} differs from rank 0 in {name}"


def test_per_rank_batchnorm_is_not_parity(tmp_path):
    """The control for the sync-BN case: the same net without sync BN does differ (2 ranks)."""
    case = dict(name="bn-per-rank", model="bnnet", optimizer="sgd", sync="gpulab", batch_size=23, steps=4)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER_PATH),
         json.dumps([case]), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got, want = torch.load(tmp_path / "bn-per-rank-rank0.pt"), reference(case)
    assert max((got[n] - want[n]).abs().max().item() for n in want if "running" not in n and "num_batches" not in n) > 1e-6


def test_ddp_and_gpulab_sync_agree(trained):
    k, out = trained
    for gpulab, ddp in (("sgd-gpulab", "sgd-ddp"), ("adam-gpulab-uneven", "adam-ddp-uneven")):
        a, b = torch.load(out / f"{gpulab}-rank0.pt"), torch.load(out / f"{ddp}-rank0.pt")
        assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-9


def test_the_unused_parameter_cases_cover_what_they_claim():
    """The branchy batches have steps where `rare` is used by some ranks only, and steps where no
    rank uses it (then plain PyTorch skips it, and weight decay would show any update)."""
    for k in (2, 3):
        some_ranks, no_rank = 0, 0
        for X, _ in worker.make_batches("branchy", 12, 8):
            used = [bool((part[:, 0] > 1.0).any()) for part in torch.tensor_split(X, k)]
            some_ranks += any(used) and not all(used)
            no_rank += not any(used)
        assert some_ranks >= 1 and no_rank >= 1, (k, some_ranks, no_rank)


@pytest.mark.parametrize("n,batch,world", [(103, 10, 3), (24, 24, 5), (7, 4, 2)])
def test_global_batches_are_split_like_tensor_split(n, batch, world):
    """Every rank's part is tensor_split's part of the one-process batch, for every step."""
    whole = list(GlobalBatches(n, batch, shuffle=True, seed=1))
    parts = [list(GlobalBatches(n, batch, shuffle=True, seed=1, rank=r, world_size=world)) for r in range(world)]
    for step, indices in enumerate(whole):
        expected = [t.tolist() for t in torch.tensor_split(torch.tensor(indices), world)]
        got = [p[step] if step < len(p) else [] for p in parts]
        assert [g for g in got if g] == [e for e in expected if e]


def test_drop_last_gives_every_rank_the_same_number_of_full_steps():
    for world in (1, 2, 3):
        lengths = {len(GlobalBatches(103, 10, shuffle=True, rank=r, world_size=world, drop_last=True)) for r in range(world)}
        assert lengths == {10}


def test_grad_sync_launches_buckets_in_order_during_backward(monkeypatch):
    """A bucket's all-reduce starts when its last gradient arrives, before backward ends, and in
    bucket order; what is left is sent by finish()."""
    import torch.distributed as dist

    launched, in_backward = [], {"now": False}

    class Handle:
        def wait(self):
            pass

    def fake_all_reduce(t, group=None, async_op=False):
        launched.append((t.numel(), in_backward["now"]))
        return Handle()

    monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    sync = GradSync(Buckets([list(model.parameters())], bucket_bytes=200, first_bucket_bytes=100), group=None)
    sizes = [sum(list(model.parameters())[i].numel() for i in g) + len(g) for g in sync.buckets.layout]
    assert len(sizes) >= 3
    sync.zero_grad()
    sync.begin_backward(communicate=True)
    loss = model(torch.randn(3, 4)).sum()

    def mark_end(grad):
        in_backward["now"] = False

    in_backward["now"] = True
    model[0].weight.register_hook(mark_end)  # the very last gradient of backward
    loss.backward()
    assert launched[0] == (sizes[0], True), "the first bucket should start while backward still runs"
    sync.finish()
    assert [n for n, _ in launched] == sizes


def test_no_communication_on_micro_batches_before_the_last(monkeypatch):
    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, group=None, async_op=False: calls.append(1) or type("H", (), {"wait": lambda self: None})())
    model = nn.Linear(4, 2)
    sync = GradSync(Buckets([list(model.parameters())]), group=None)
    sync.zero_grad()
    for last in (False, False, True):
        sync.begin_backward(communicate=last)
        model(torch.randn(3, 4)).sum().backward()
        assert len(calls) == (1 if last else 0)
    sync.finish()
    assert len(calls) == 1
