"""Base Batch Shuffling: partitions, balance, determinism, state, cost, plugin and bench."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemcore.config import ModelConfig
from gemcore.data import BaseBatchShuffler, RandomBatchSampler
from gemcore.data.bbs import (_unique_keys, balanced_partition, default_model_cost, gem_rule_loads,
                              random_loads)
from gemcore.data.workloads import history_lengths
from gemcore.model import GemModel
from gemcore.plugin_manager import create_plugin_manager


def heavytail(n: int, max_len: int, seed: int = 0) -> torch.Tensor:
    return history_lengths("heavytail", n, max_len, torch.Generator().manual_seed(seed))


def epoch_lists(lengths, world_size, global_batch, **kw):
    """Every rank's lists for epoch 0, each rank with its own shuffler (no shared state)."""
    per_rank = []
    for rank in range(world_size):
        s = BaseBatchShuffler(lengths, world_size=world_size, rank=rank, global_batch=global_batch, **kw)
        it = iter(s)
        per_rank.append([next(it) for _ in range(s.steps_per_epoch())])
    return per_rank


@pytest.mark.parametrize("n, world_size, global_batch, drop_last", [
    (100, 4, 32, False),   # tail of 4 samples: one per rank
    (100, 4, 32, True),
    (103, 8, 24, False),   # tail of 7 < world size: one rank gets an empty list
    (5, 8, 8, False),      # fewer samples than ranks
    (64, 3, 10, False),    # global batch not a multiple of the world size
    (1, 1, 1, False),
])
def test_epoch_partitions_the_dataset(n, world_size, global_batch, drop_last):
    lengths = heavytail(n, 64, seed=n)
    lists = epoch_lists(lengths, world_size, global_batch, drop_last=drop_last, sub_batch=4)
    steps = len(lists[0])
    seen = []
    for step in range(steps):
        sizes = [len(lists[r][step]) for r in range(world_size)]
        assert max(sizes) - min(sizes) <= 1, sizes
        for r in range(world_size):
            seen += lists[r][step]
    if drop_last:
        assert len(seen) == (n // global_batch) * global_batch
        assert len(set(seen)) == len(seen)
    else:
        assert sorted(seen) == list(range(n))


def test_ranks_agree_without_communication_and_match_the_plan():
    lengths = heavytail(4096, 512)
    world, gb = 8, 512
    shufflers = [BaseBatchShuffler(lengths, world_size=world, rank=r, global_batch=gb, seed=3) for r in range(world)]
    plans = [s.plan(1, 2) for s in shufflers]
    for p in plans[1:]:
        assert np.array_equal(p.indices, plans[0].indices) and np.array_equal(p.rank_cost, plans[0].rank_cost)
    step_batch = shufflers[0].step_samples(1, 2)
    assert sorted(plans[0].indices.tolist()) == sorted(step_batch.tolist())
    for r, s in enumerate(shufflers):
        local = s.local_batch(plans[0])
        assert sorted(local.tolist()) == sorted(plans[0].rank_indices(r).tolist())
        costs = s.costs[plans[0].rank_indices(r)].sum()
        assert costs == pytest.approx(plans[0].rank_cost[r], rel=1e-12)


def test_balance_beats_gem_rule_and_reaches_the_goal_at_64_ranks():
    world, per_rank = 64, 1024
    lengths = heavytail(world * per_rank * 2, 4096)
    s = BaseBatchShuffler(lengths, world_size=world, rank=0, global_batch=world * per_rank)
    for step in range(2):
        plan = s.plan(0, step)
        costs = s.costs[s.step_samples(0, step)]
        gem = gem_rule_loads(costs, world)
        rnd = random_loads(costs, world)
        assert plan.imbalance <= 1.02
        assert plan.imbalance <= gem.max() / gem.mean() < rnd.max() / rnd.mean()
        assert gem.sum() == pytest.approx(costs.sum()) and rnd.sum() == pytest.approx(costs.sum())


def _check_partition(c: np.ndarray, groups: int) -> None:
    group, loads = balanced_partition(c, groups)
    counts = np.bincount(group, minlength=groups)
    assert counts.sum() == c.size and counts.max() - counts.min() <= 1
    expected = np.bincount(group, weights=c, minlength=groups) if c.size else np.zeros(groups)
    np.testing.assert_allclose(loads, expected)
    # merging rows never widens the spread beyond the widest row: at most the largest item
    assert loads.max() - loads.min() <= (c.max() if c.size else 0.0)


@settings(max_examples=60, deadline=None)
@given(costs=st.lists(st.integers(0, 10**6), min_size=0, max_size=200), groups=st.integers(1, 17))
def test_balanced_partition_cardinality_and_spread_bound(costs, groups):
    _check_partition(np.array(costs, dtype=np.float64), groups)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5000), groups=st.integers(1, 40), seed=st.integers(0, 2**31),
       law=st.sampled_from(["lognormal", "ties", "uniform"]))
def test_balanced_partition_bound_with_serpentine_folding(n, groups, seed, law):
    """Large enough that blocks of sorted rounds are folded before the merge (rounds >= 128)."""
    rng = np.random.default_rng(seed)
    c = {"lognormal": lambda: rng.lognormal(5, 1.5, n) ** 2, "ties": lambda: rng.integers(0, 3, n) * 1.0,
         "uniform": lambda: rng.random(n)}[law]()
    _check_partition(c, groups)


def test_unique_keys_are_sort_order_independent():
    rng = np.random.default_rng(0)
    values = rng.integers(0, 5, (50, 64)).astype(np.float64)  # many ties
    keys = _unique_keys(values)
    orders = [np.argsort(keys, axis=1, kind=k) for k in ("quicksort", "mergesort", "heapsort")]
    assert all(np.array_equal(orders[0], o) for o in orders[1:])
    assert (np.diff(np.take_along_axis(values, orders[0], axis=1), axis=1) >= 0).all()


def _steps(sampler, first_epoch: int, count: int) -> list[list[int]]:
    """``count`` steps from the sampler's position, driving the epochs as the trainer does."""
    out, epoch = [], first_epoch
    while True:
        for local in sampler:
            out.append(local)
            if len(out) == count:
                return out
        epoch += 1
        sampler.set_epoch(epoch)


def test_state_dict_resumes_the_same_sequence_and_epochs_differ():
    lengths = heavytail(300, 128)
    kw = dict(world_size=2, rank=1, global_batch=64, seed=5, sub_batch=8)
    a = BaseBatchShuffler(lengths, **kw)
    full = _steps(a, 0, 12)  # crosses the epoch boundary (5 steps per epoch)
    b = BaseBatchShuffler(lengths, **kw)
    _steps(b, 0, 7)          # stops in epoch 1, after its second step
    assert b.state_dict()["epoch"] == 1 and b.state_dict()["step_in_epoch"] == 2
    c = BaseBatchShuffler(lengths, **kw)
    c.load_state_dict(b.state_dict())
    assert _steps(c, 1, 5) == full[7:]
    assert sorted(sum(full[0:5], [])) != sorted(sum(full[5:10], [])) or full[0:5] != full[5:10]
    other = BaseBatchShuffler(heavytail(301, 128), **kw)
    with pytest.raises(ValueError, match="num_samples"):
        other.load_state_dict(a.state_dict())


@pytest.mark.parametrize("name", ["bbs", "random"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterating_a_sampler_yields_one_epoch_then_set_epoch_starts_the_next(name, drop_last):
    """torch's convention (DistributedSampler): ``for batch in sampler`` ends after ``len(sampler)``
    steps, and iterating again repeats that epoch; set_epoch(e) starts epoch e (another order),
    from its first step."""
    manager = create_plugin_manager()
    factory = manager.resolve("data", name).factory
    s = factory(heavytail(300, 64), batch_size=64, world_size=2, rank=0, seed=3, drop_last=drop_last)
    assert len(s) == (4 if drop_last else 5)
    first = list(s)
    assert len(first) == len(s)
    assert list(s) == first                    # the same epoch again until set_epoch
    s.set_epoch(1)
    second = list(s)
    assert len(second) == len(s) and second != first
    s.set_epoch(0)
    assert list(s) == first                    # an epoch is a pure function of (seed, epoch)
    # mid-epoch state: iterating yields the rest of the epoch
    s.set_epoch(1)
    it = iter(s)
    next(it), next(it)
    state = s.state_dict()
    resumed = factory(heavytail(300, 64), batch_size=64, world_size=2, rank=0, seed=3, drop_last=drop_last)
    resumed.load_state_dict(state)
    assert list(resumed) == second[2:]
    assert list(resumed) == second             # after the resumed rest, the whole epoch again
    assert len(resumed) == len(s)


def test_sub_batches_are_balanced():
    lengths = heavytail(4096, 1024)
    s = BaseBatchShuffler(lengths, world_size=2, rank=0, global_batch=2048, sub_batch=128)
    local = s.local_batch(s.plan(0, 0))
    sizes = s.sub_batch_sizes(local.size)
    assert sum(sizes) == local.size == 1024 and len(sizes) == 8
    bounds = np.cumsum([0] + sizes)
    loads = np.array([s.costs[local[a:b]].sum() for a, b in zip(bounds[:-1], bounds[1:])])
    assert loads.max() - loads.min() <= s.costs[local].max()
    assert loads.max() / loads.mean() < 1.05


def test_default_cost_is_the_models_flop_counter():
    cfg = ModelConfig()
    model = GemModel(cfg, attention=None)
    lengths = torch.tensor([0, 1, 7, 300, 4096])
    got = default_model_cost()(lengths)
    want = torch.tensor([model.flops(int(n), int(n) ** 2) for n in lengths], dtype=torch.float64)
    torch.testing.assert_close(got, want)
    s = BaseBatchShuffler(lengths, world_size=1, rank=0, global_batch=5)
    np.testing.assert_allclose(s.costs, want.numpy())
    custom = BaseBatchShuffler(lengths, world_size=1, rank=0, global_batch=5, cost=lambda L: L.double() * 3)
    np.testing.assert_allclose(custom.costs, lengths.numpy() * 3.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size"),
    (dict(rank=4), "rank"),
    (dict(global_batch=2), "global_batch"),
    (dict(sub_batch=0), "sub_batch"),
    (dict(seed=-1), "seed"),
    (dict(cost="nope"), "cost"),
    (dict(cost=lambda L: -L.double()), "cost"),
    (dict(cost=lambda L: L[:1].double()), "cost"),
])
def test_bad_arguments_raise_value_errors_naming_them(kwargs, match):
    args = dict(world_size=4, rank=0, global_batch=8)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        BaseBatchShuffler(torch.arange(1, 20), **args)


def test_empty_lengths_rejected():
    with pytest.raises(ValueError, match="lengths"):
        BaseBatchShuffler(torch.zeros(0, dtype=torch.long), world_size=1, rank=0, global_batch=1)


def test_bbs_is_a_sampler_through_the_data_hook_and_random_ignores_cost():
    manager = create_plugin_manager()
    lengths = heavytail(200, 64)
    common = dict(batch_size=32, world_size=2, rank=1, seed=0, drop_last=False)
    bbs = manager.resolve("data", "bbs").factory(lengths, **common, cost="tokens", sub_batch=4)
    assert isinstance(bbs, BaseBatchShuffler) and bbs.sub_batch == 4
    assert len(next(iter(bbs))) == 16
    random_factory = manager.resolve("data", "random").factory
    plain = iter(random_factory(lengths, **common))
    with_cost = iter(random_factory(lengths, **common, cost=lambda L: L.double(), sub_batch=8))
    assert [next(plain) for _ in range(3)] == [next(with_cost) for _ in range(3)]
    assert isinstance(random_factory(lengths, **common), RandomBatchSampler)


def test_bench_json(capsys):
    from gemcore.cli.main import main

    assert main(["bench", "bbs", "--ranks", "4,16", "--per-rank", "64", "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["ranks"] for r in out["results"]] == [4, 16]
    for r in out["results"]:
        assert set(r) >= {"ranks", "random", "gem_rule", "bbs", "plan_ms"}
        assert 1.0 <= r["bbs"] <= r["gem_rule"] and r["random"] > 1.0 and r["plan_ms"] > 0
