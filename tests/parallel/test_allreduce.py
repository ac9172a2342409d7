import pytest
import torch

from gpulab.errors import UserError
from gpulab.parallel import Buckets, allreduce
from gpulab.parallel.allreduce import bucket_layout, choose

CPU = torch.device("cpu")


@pytest.mark.parametrize("algorithm", ["naive", "ring", "auto"])
@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 7, 100, 1001])
def test_every_tensor_holds_the_exact_sum(algorithm, k, numel):
    g = torch.Generator().manual_seed(k * 1000 + numel)
    # Integers in float64 make the expected sum exact whatever the summation order.
    tensors = [torch.randint(-1000, 1000, (numel,), generator=g).double() for _ in range(k)]
    expected = torch.stack(tensors).sum(0) if numel else torch.zeros(0, dtype=torch.float64)
    allreduce(tensors, algorithm)
    for t in tensors:
        assert torch.equal(t, expected)


@pytest.mark.parametrize("algorithm", ["naive", "ring"])
def test_multidimensional_float32(algorithm):
    tensors = [torch.randn(3, 5, 7) for _ in range(4)]
    expected = torch.stack(tensors).sum(0)
    allreduce(tensors, algorithm)
    for t in tensors:
        torch.testing.assert_close(t, expected)
        assert t.shape == (3, 5, 7)


def test_tensors_stay_where_they_were():
    tensors = [torch.ones(10) for _ in range(3)]
    ids = [t.data_ptr() for t in tensors]
    allreduce(tensors, "ring")
    assert [t.data_ptr() for t in tensors] == ids  # in place
    assert all(t.device == CPU for t in tensors)


def test_mismatched_shapes_and_dtypes_are_clear_errors():
    with pytest.raises(UserError, match="equal shapes"):
        allreduce([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(UserError, match="dtypes"):
        allreduce([torch.zeros(3), torch.zeros(3, dtype=torch.float64)])
    with pytest.raises(UserError, match="no tensors"):
        allreduce([])
    with pytest.raises(UserError, match="unknown allreduce algorithm"):
        allreduce([torch.zeros(3)], "magic")


def test_nccl_refused_off_gpu_and_auto_picks_naive_for_virtual_replicas():
    with pytest.raises(UserError, match="nccl"):
        allreduce([torch.zeros(3), torch.zeros(3)], "nccl")
    assert choose([torch.zeros(3), torch.zeros(3)], "auto") == "naive"


def test_bucket_layout_is_reverse_order_with_a_small_first_bucket():
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(4, 3), (5,), (2, 2, 2), (6,)]]  # 48, 20, 32, 24 B
    # Backward reaches the last parameter first. First bucket capped at 40 B: 24 B, then 32 would
    # exceed it. Later buckets at 64 B: 32 + 20 = 52, then 48 more would exceed it.
    assert bucket_layout(params, bucket_bytes=64, first_bucket_bytes=40) == [[3], [2, 1], [0]]
    # A parameter larger than the cap gets a bucket of its own rather than being refused.
    assert bucket_layout(params, bucket_bytes=16, first_bucket_bytes=16) == [[3], [2], [1], [0]]
    # One dtype per bucket.
    mixed = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    assert bucket_layout(mixed, bucket_bytes=2**20, first_bucket_bytes=2**20) == [[1], [0]]


def test_buckets_make_grads_views_and_reduce_them():
    replicas = [[torch.nn.Parameter(torch.zeros(s)) for s in [(4, 3), (5,), (2, 2, 2)]] for _ in range(3)]
    buckets = Buckets(replicas, bucket_bytes=64, first_bucket_bytes=32)
    assert buckets.layout == [[2], [1], [0]]
    for r, params in enumerate(replicas):
        for p in params:
            p.grad.fill_(r + 1)  # writes through the view into the flat buffer
    buckets.allreduce("ring")
    for params in replicas:
        for p in params:
            assert torch.equal(p.grad, torch.full_like(p, 6.0))
    buckets.zero_()
    assert all(p.grad.abs().sum() == 0 for params in replicas for p in params)


def test_parameters_used_by_no_replica_are_found_and_hidden_from_the_optimizer():
    replicas = [[torch.nn.Parameter(torch.zeros(3)) for _ in range(3)] for _ in range(2)]
    buckets = Buckets(replicas, bucket_bytes=8, first_bucket_bytes=8)  # one parameter per bucket
    buckets.mark_ready(0, 0)  # parameter 0 used on replica 0 only, parameter 1 on replica 1 only
    buckets.mark_ready(1, 1)
    assert buckets.unused_here() == [2]
    views = [p.grad for p in replicas[0]]
    with buckets.hidden_grads([2]):
        assert replicas[0][2].grad is None and replicas[1][2].grad is None
        assert replicas[0][0].grad is views[0]
    assert replicas[0][2].grad is views[2]  # the bucket view is back after the step
    buckets.zero_()
    assert buckets.unused_here() == [0, 1, 2]


def test_ranks_learn_which_parameters_some_rank_used_from_the_reduced_flags():
    """Two single-replica Buckets stand for two ranks: each seals its buckets, the sum is reduced."""
    ranks = [Buckets([[torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]], bucket_bytes=16, first_bucket_bytes=8)
             for _ in range(2)]
    assert ranks[0].layout == [[2], [1, 0]]
    ranks[1].mark_ready(0, 1)  # rank 0 used nothing, rank 1 used parameter 1
    for b in range(2):
        allreduce([ranks[0].seal(0, b), ranks[1].seal(0, b)], "naive")
    assert ranks[0].unused_after_reduce() == [2, 0] and ranks[1].unused_after_reduce() == [2, 0]
    for r in ranks:
        r.zero_()
        for i in range(3):
            r.mark_ready(0, i)
    assert ranks[0].unused_after_reduce() == []  # all used here: known without reading the device


def test_frozen_parameters_get_no_bucket_and_keep_no_grad():
    frozen, trainable = torch.nn.Parameter(torch.zeros(4), requires_grad=False), torch.nn.Parameter(torch.zeros(4))
    buckets = Buckets([[frozen, trainable]])
    assert buckets.params == [[trainable]] and frozen.grad is None and trainable.grad is not None


def test_a_bucket_is_complete_when_its_last_gradient_arrives():
    params = [[torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]]
    buckets = Buckets(params, bucket_bytes=16, first_bucket_bytes=8)
    assert buckets.layout == [[2], [1, 0]]
    assert buckets.mark_ready(0, 2) == 0
    assert buckets.mark_ready(0, 1) is None
    assert buckets.mark_ready(0, 0) == 1
    buckets.expect_gradients()  # the next backward waits for every gradient again
    assert buckets.mark_ready(0, 0) is None


def test_ready_listeners_hear_every_bucket_complete_during_backward():
    replicas = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)) for _ in range(2)]
    buckets = Buckets([list(m.parameters()) for m in replicas], bucket_bytes=64, first_bucket_bytes=16)
    assert buckets.num_buckets == 4
    heard = []
    buckets.add_ready_listener(lambda replica, b: heard.append((replica, b)))
    for step in range(2):
        buckets.expect_gradients()
        for r, model in enumerate(replicas):
            model(torch.randn(3, 4)).sum().backward()
            assert sorted(heard) == [(r, b) for b in range(4)], f"step {step}, replica {r}"
            heard.clear()
    assert buckets.unused_here() == []  # the hooks marked every parameter used


def test_bucket_grads_keep_the_parameter_layout():
    w = torch.nn.Parameter(torch.randn(8, 4, 3, 3).to(memory_format=torch.channels_last))
    Buckets([[w]])
    assert w.grad.stride() == w.stride()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA GPUs")
@pytest.mark.parametrize("algorithm", ["naive", "ring", "nccl"])
def test_gpu_allreduce(algorithm):
    tensors = [torch.full((1001,), float(i + 1), device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    total = sum(range(1, len(tensors) + 1))
    allreduce(tensors, algorithm)
    for i, t in enumerate(tensors):
        assert t.device == torch.device(f"cuda:{i}")
        assert torch.equal(t.cpu(), torch.full((1001,), float(total)))
