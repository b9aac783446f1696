"""gemcore.metrics: the held-out AUC on hand-computed cases, and the peak FLOP/s lookup."""
from __future__ import annotations

import math

import pytest
import torch

from gemcore.metrics import auc, peak_flops, peak_flops_of_name


@pytest.mark.parametrize("scores,labels,want", [
    ([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1], 0.75),          # 3 of the 4 (pos, neg) pairs ordered
    ([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1], 1.0),            # perfect
    ([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1], 0.0),            # reversed
    ([0.5, 0.5], [0, 1], 0.5),                            # one tied pair counts one half
    ([0.1, 0.5, 0.5, 0.9], [0, 1, 0, 1], 0.875),          # pairs: 1 + 0.5 + 1 + 1 of 4
    ([0.7, 0.7, 0.7, 0.7, 0.7], [1, 0, 1, 0, 0], 0.5),    # all tied
    ([0.2, 0.2, 0.6, 0.6, 0.9], [0, 1, 0, 1, 1], 4 / 6),  # pos {0.2, 0.6, 0.9} x neg {0.2, 0.6}: 0.5+0+1+0.5+1+1
])
def test_auc_on_hand_computed_cases(scores, labels, want):
    got = auc(torch.tensor(scores), torch.tensor(labels))
    assert got == pytest.approx(want, abs=1e-12)
    # the order of the samples does not matter
    perm = torch.randperm(len(scores), generator=torch.Generator().manual_seed(0))
    assert auc(torch.tensor(scores)[perm], torch.tensor(labels)[perm]) == pytest.approx(want, abs=1e-12)


def test_auc_matches_the_pair_count_on_random_scores_with_ties():
    gen = torch.Generator().manual_seed(1)
    scores = torch.randint(0, 5, (200,), generator=gen).double()  # many ties
    labels = torch.rand(200, generator=gen) < 0.3
    pos, neg = scores[labels], scores[~labels]
    diff = pos[:, None] - neg[None, :]
    want = float(((diff > 0).double() + 0.5 * (diff == 0).double()).mean())
    assert auc(scores, labels) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("labels", [[1, 1, 1], [0, 0, 0]])
def test_auc_is_nan_without_both_classes(labels):
    assert math.isnan(auc(torch.tensor([0.1, 0.2, 0.3]), torch.tensor(labels)))


def test_peak_flops_by_device_name():
    assert peak_flops_of_name("NVIDIA H200") == 989e12
    assert peak_flops_of_name("NVIDIA H100 80GB HBM3") == 989e12
    assert peak_flops_of_name("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops_of_name("NVIDIA B200") == 2250e12
    assert peak_flops_of_name("Some Other GPU") is None
    assert peak_flops(torch.device("cpu")) is None
