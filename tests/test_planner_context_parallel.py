"""Context parallelism's bookkeeping in one process: the row split is cost-balanced, the shares tile
the batch, and the shares' attention (own sequences through the hook, continuations through
offset_attention on the earlier ranks' K/V) equals the jagged reference on the whole batch, with
gradients. The multi-rank runs are in test_planner_apply.py."""
import functools
import random

import pytest
import torch
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference

from gemcore.parallel.context import (
    attend_share,
    make_share,
    offset_attention,
    split_rows,
)


def _batch(rng: random.Random, num_seqs: int, max_len: int):
    lengths = [rng.choice([0, 1, rng.randint(0, max_len)]) for _ in range(num_seqs - 1)]
    lengths.insert(rng.randint(0, len(lengths)), rng.randint(1, max_len))  # at least one row
    targets = [rng.randint(0, n) for n in lengths]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    return offsets, torch.tensor(targets)


def _random_cuts(rng: random.Random, total: int, cp: int) -> list[int]:
    return [0, *sorted(rng.randint(0, total) for _ in range(cp - 1)), total]


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("seed", range(4))
def test_shares_attention_equals_the_whole_batch(activation, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    offsets, targets = _batch(rng, rng.randint(1, 5), 12)
    T, H, D = int(offsets[-1]), 2, 4
    max_seqlen = max(int(offsets.diff().max()), 1)
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64, requires_grad=True) for _ in range(3))
    attend = functools.partial(jagged_attention_reference, activation=activation)  # float64: no checks
    want = attend(q, k, v, offsets, causal=True, num_targets=targets, max_seqlen=max_seqlen)
    weights = torch.randn_like(want)
    want_grads = torch.autograd.grad((want * weights).sum(), (q, k, v))
    for cp in (1, 2, 3, 5):
        cuts = split_rows(offsets, targets, cp, attn_flops=1.0, row_flops=2.0) if cp < 5 else \
            _random_cuts(rng, T, cp)
        outs = []
        for rank in range(cp):
            share = make_share(offsets, targets, cuts, rank, None, max_seqlen)
            rows = slice(share.start, share.end)
            kv = torch.cat([k, v], dim=-1)
            before = kv[share.start - share.cont_before:share.start]
            assert sum(share.carries[r] for r in share.cont_from) == share.cont_before
            outs.append(attend_share(q[rows], k[rows], v[rows], share, before, attend, activation=activation,
                                     scale=None, norm=None, max_seqlen=max_seqlen))
        got = torch.cat(outs)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        grads = torch.autograd.grad((got * weights).sum(), (q, k, v))
        for g, w in zip(grads, want_grads):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_offset_attention_is_the_tail_of_the_reference():
    torch.manual_seed(0)
    L, history = 9, 6
    q, k, v = (torch.randn(L, 2, 4, dtype=torch.float64) for _ in range(3))
    offsets, targets = torch.tensor([0, L]), torch.tensor([L - history])
    want = jagged_attention_reference(q, k, v, offsets, causal=True, num_targets=targets)
    for start in (0, 1, 5, 7, L - 1):
        got = offset_attention(q[start:], k, v, q_start=start, history=history, activation="softmax",
                               scale=None, norm=None)
        torch.testing.assert_close(got, want[start:])


@pytest.mark.parametrize("seed", range(3))
def test_split_is_cost_balanced_and_tiles_the_rows(seed):
    rng = random.Random(seed)
    offsets, targets = _batch(rng, 40, 60)
    T = int(offsets[-1])
    lengths = offsets.diff().tolist()
    cost = []
    for n, t in zip(lengths, targets.tolist()):
        cost += [3.0 * (min(i, n - t) + 1) + 5.0 for i in range(n)]
    for cp in (1, 2, 4, 7):
        cuts = split_rows(offsets, targets, cp, attn_flops=3.0, row_flops=5.0)
        assert cuts[0] == 0 and cuts[-1] == T and cuts == sorted(cuts)
        shares = [sum(cost[a:b]) for a, b in zip(cuts, cuts[1:])]
        assert max(shares) - sum(cost) / cp <= max(cost) + 1e-9
        rows = 0
        for rank in range(cp):
            share = make_share(offsets, targets, cuts, rank, None, 60)
            assert int(share.own_offsets[0]) == share.cont_rows
            assert int(share.own_offsets[-1]) == share.end - share.start
            assert (share.own_targets <= share.own_offsets.diff()).all()
            rows += share.end - share.start
        assert rows == T
