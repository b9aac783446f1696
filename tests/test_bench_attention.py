"""gem bench attention's helpers that run without a GPU: the useful FLOP count and the tile tune's
bookkeeping (timings are faked; the real ones need a GPU)."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from gemcore.bench import attention as bench  # noqa: E402
from gemcore.kernels import jagged_attention_triton as jt  # noqa: E402


def test_useful_flops_count_real_tokens_and_halve_for_causal():
    lengths = torch.tensor([3, 0, 5])
    full = bench.useful_fwd_flops(lengths, None, 2, 8, causal=False)
    assert full == 4 * (9 + 0 + 25) * 2 * 8
    assert bench.useful_fwd_flops(lengths, None, 2, 8, causal=True) == full / 2
    cross = bench.useful_fwd_flops(lengths, torch.tensor([4, 4, 4]), 2, 8, causal=False)
    assert cross == 4 * (12 + 0 + 20) * 2 * 8


def test_tune_installs_the_fastest_tile_times_as_asked_and_sweeps_with_the_gluon_kernels_off(monkeypatch):
    candidates = {"fwd": [(64, 32, 4, 3), (128, 32, 4, 4)], "dq": [(64, 64, 4, 2), (64, 32, 4, 2)]}
    fastest = {"fwd": (128, 32, 4, 4), "dq": (64, 32, 4, 2)}
    seen = []

    def fake_median_ms(fn, iters=None, **kwargs):
        kernel = next(k for k in ("fwd", "dq") if k in jt._pinned)
        seen.append((kernel, kwargs.get("launch_hidden"), os.environ.get("GEMCORE_GLUON_ATTENTION")))
        pinned = jt._pinned[kernel]
        return 1.0 if (pinned.block_m, pinned.block_n, pinned.num_warps, pinned.num_stages) == fastest[kernel] else 2.0

    monkeypatch.setattr(bench, "TUNE_CANDIDATES", candidates)
    monkeypatch.setattr(bench, "median_ms", fake_median_ms)
    monkeypatch.setattr(jt, "CONFIGS", dict(jt.CONFIGS))
    monkeypatch.delenv("GEMCORE_GLUON_ATTENTION", raising=False)
    x = torch.zeros(4, 2, 128, requires_grad=True)
    bench.tune(lambda: x * 2, (x,), 128, 1e9, "softmax", gpu_time=True)
    assert jt.CONFIGS[("fwd", 128)] == jt.TileConfig(*fastest["fwd"])
    assert jt.CONFIGS[("dq", 128)] == jt.TileConfig(*fastest["dq"])
    # every tile with the Gluon kernels off and timed in GPU time, the switch restored after
    assert [k for k, _, _ in seen] == ["fwd", "fwd", "dq", "dq"]
    assert all(hidden and switch == "0" for _, hidden, switch in seen)
    assert "GEMCORE_GLUON_ATTENTION" not in os.environ


def test_model_workload_is_the_models_attention_shape():
    from gemcore.bench.attention import MODEL_SHAPE, WORKLOADS, workload_lengths

    assert "model" in WORKLOADS
    lengths, kv = workload_lengths("model")
    assert kv is None and lengths.numel() == MODEL_SHAPE["users"] == 48
    n = MODEL_SHAPE["candidates"]
    assert int(lengths.min()) >= 8 + n and int(lengths.max()) <= MODEL_SHAPE["max_len"] + n
    assert torch.equal(lengths, workload_lengths("model")[0])  # seeded
