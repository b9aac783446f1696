"""gemcore.data.workloads: the length laws and the benchmark workloads, defined once."""
from __future__ import annotations


import pytest
import torch

from gemcore.data.workloads import ATTENTION_WORKLOADS, LENGTH_LAWS, history_lengths, workload_lengths


def _draw(law, n, max_len, seed=0):
    return history_lengths(law, n, max_len, torch.Generator().manual_seed(seed))


def test_dense95_excludes_its_maximum():
    x = _draw("dense95", 20_000, 100)
    assert x.dtype == torch.int64
    assert int(x.min()) == 90 and int(x.max()) == 99  # [int(0.9 * 100), 100)
    assert abs(float(x.float().mean()) - 94.5) < 0.2


def test_uniform_includes_its_maximum():
    x = _draw("uniform", 20_000, 50)
    assert int(x.min()) == 1 and int(x.max()) == 50


def test_heavytail_median_sigma_and_clip():
    max_len = 4096
    x = _draw("heavytail", 100_000, max_len)
    assert int(x.min()) >= 8 and int(x.max()) == max_len  # clipped at both ends
    assert abs(float(x.float().median()) - max_len / 16) < 5  # median max_len / 16 (integer part)
    inner = x[(x > 16) & (x < 2048)].double().log()
    assert 1.0 < float(inner.std()) < 1.2  # sigma 1.2 narrowed by the truncation to the window


@pytest.mark.parametrize("law", LENGTH_LAWS)
@pytest.mark.parametrize("max_len", [1, 2, 7, 64])
def test_every_law_stays_in_one_to_max_len(law, max_len):
    x = _draw(law, 2000, max_len)
    assert x.shape == (2000,) and int(x.min()) >= 1 and int(x.max()) <= max_len


@pytest.mark.parametrize("law", LENGTH_LAWS)
def test_laws_are_deterministic_by_seed(law):
    assert torch.equal(_draw(law, 100, 512, seed=3), _draw(law, 100, 512, seed=3))
    assert not torch.equal(_draw(law, 100, 512, seed=3), _draw(law, 100, 512, seed=4))


def test_bench_workloads():
    dense, kv = workload_lengths("dense95")
    assert kv is None and dense.shape == (256,) and int(dense.min()) >= 1843 and int(dense.max()) < 2048
    heavy, kv = workload_lengths("heavytail")
    assert kv is None and heavy.shape == (256,) and int(heavy.max()) <= 4096
    q, kv = workload_lengths("cross")
    assert q.shape == kv.shape == (1152,) and bool((kv == 256).all()) and int(q.max()) <= 2048
    assert torch.equal(workload_lengths("heavytail")[0], heavy)
    model, kv = workload_lengths("model")
    assert kv is None and model.shape == (48,) and int(model.min()) >= 8 + 16 and int(model.max()) <= 4096 + 16
    assert set(ATTENTION_WORKLOADS) == {"dense95", "heavytail", "cross", "model"}


@pytest.mark.parametrize("args,words", [
    (("zipf", 4, 64), "length law"),
    (("uniform", -1, 64), "n must be"),
    (("dense95", 4, 0), "max_len must be"),
])
def test_bad_arguments_are_named(args, words):
    with pytest.raises(ValueError, match=words):
        history_lengths(*args)
    with pytest.raises(ValueError, match="workload"):
        workload_lengths("sparse")
