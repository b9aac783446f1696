"""The torch-native attention peers (``varlen``, ``flex``) against the jagged reference on the cases
they can express, their plugin wiring, and their `gem bench train` configurations.

On CPU: FlexAttention's eager forward (torch has no FlexAttention backward on CPU). On a CUDA GPU
(marked gpu): compiled FlexAttention and ``varlen_attn``, forward and gradients, bf16.
"""
from __future__ import annotations

import pytest
import torch

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference
from gemcore.kernels.torch_attention import (flex_attention_jagged, make_flex_attention,
                                             make_varlen_attention, token_tables, varlen_attention)
from gemcore.model import GemModel

CUDA = torch.cuda.is_available()
LENGTHS = [0, 1, 5, 130, 7, 0, 40]
TARGETS = [0, 1, 2, 20, 7, 0, 39]  # none, all, and candidates far past history + window


def _inputs(lengths, H=2, D=16, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = torch.nn.functional.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(device)
    T = sum(lengths)
    q, k, v = (torch.randn(T, H, D, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(3))
    return q, k, v, offsets


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def test_token_tables_mark_sequence_position_and_history():
    offsets = torch.tensor([0, 0, 3, 4])
    seq, pos, history = token_tables(offsets, torch.tensor([0, 1, 1]), 4, 6)
    assert seq.tolist() == [1, 1, 1, 2, 3, 3]          # padding rows: a sequence of their own
    assert pos.tolist() == [0, 1, 2, 0, 0, 1]
    assert history.tolist() == [2, 2, 2, 0, 2, 2]


@pytest.mark.parametrize("window", [None, (1, 0), (3, None), (0, 0), (50, 0)])
@pytest.mark.parametrize("targets", [None, TARGETS])
def test_flex_matches_the_reference_on_cpu(window, targets):
    q, k, v, offsets = _inputs(LENGTHS)
    nt = None if targets is None else torch.tensor(targets)
    got = flex_attention_jagged(q, k, v, offsets, num_targets=nt, window=window, compiled=False)
    want = jagged_attention_reference(q, k, v, offsets, causal=True, num_targets=nt, window=window)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_flex_full_attention_and_scale_on_cpu():
    q, k, v, offsets = _inputs([3, 0, 17])
    got = flex_attention_jagged(q, k, v, offsets, causal=False, scale=0.3, compiled=False)
    want = jagged_attention_reference(q, k, v, offsets, scale=0.3)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_peers_take_softmax_only_and_name_the_setting():
    for make in (make_varlen_attention, make_flex_attention):
        with pytest.raises(ValueError, match="attention.activation=softmax"):
            make(AttentionConfig(activation="silu"))


def test_varlen_needs_cuda_tensors():
    q, k, v, offsets = _inputs([3, 4], dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA"):
        varlen_attention(q, k, v, offsets)


def test_flex_peer_runs_in_the_model_on_cpu():
    """The hook's callable in a model: the same logits as the reference implementation."""
    from gemcore.data import make_synthetic
    from gemcore.kernels.jagged_attention import make_attention

    data = make_synthetic(num_users=5, num_items=40, num_actions=4, max_len=12, num_candidates=3,
                          num_clusters=4, kind="uniform", seed=1)
    batch = data.__getitems__(range(5))
    cfg = ModelConfig(hidden=16, num_heads=2, num_blocks=2, num_items=40)
    torch.manual_seed(0)
    ref = GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))
    torch.manual_seed(0)
    flex = GemModel(cfg, make_flex_attention(AttentionConfig(), compiled=False))
    with torch.no_grad():
        torch.testing.assert_close(flex(batch), ref(batch), rtol=1e-4, atol=1e-5)


def test_plugin_registers_the_peers():
    from gemcore.plugin_manager import create_plugin_manager

    names = create_plugin_manager().implementations("attention")
    assert {"varlen", "flex"} <= set(names)


def test_bench_train_builds_peers_with_softmax_attention(monkeypatch):
    """`gem bench train --configs flex` puts the flex peer in the model (no GPU needed to build)."""
    import gemcore.kernels.torch_attention as ta
    from gemcore.bench import train
    from gemcore.plugin_manager import create_plugin_manager

    assert {"varlen", "varlen+compile", "flex", "flex+compile"} <= set(train.CONFIGS)
    seen = []
    monkeypatch.setattr(ta, "flex_attention_jagged", lambda *a, **kw: seen.append(kw) or a[0])
    cfg = ModelConfig(hidden=16, num_heads=2, num_blocks=1, num_items=40)
    _, gem, _, desc = train.build("flex", cfg, create_plugin_manager(), torch.device("cpu"), 0)
    assert desc.startswith("jagged flex")
    q = torch.zeros(3, 2, 8)
    gem.blocks[0].attention(q, q, q, torch.tensor([0, 3]), causal=True, num_targets=torch.tensor([1]))
    assert seen and seen[0]["num_targets"].tolist() == [1]


# --------------------------------------------------------------------------- GPU
def _grads_close(got, want, inputs_got, inputs_want, tol):
    g = torch.randn(got.shape, generator=torch.Generator(device=got.device).manual_seed(1), device=got.device)
    a = torch.autograd.grad(got, inputs_got, g.to(got.dtype))
    b = torch.autograd.grad(want, inputs_want, g.double())
    for name, x, y in zip("qkv", a, b):
        assert _rel_err(x, y) <= tol, ("d" + name, _rel_err(x, y))


def _gpu_case(lengths, D=128):
    q, k, v, offsets = _inputs(lengths, H=4, D=D, dtype=torch.bfloat16, device="cuda")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    return (q, k, v), (q64, k64, v64), offsets


GPU_LENGTHS = [0, 1, 700, 1, 129, 300, 64, 2000]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, (37, 0)])
def test_compiled_flex_matches_the_reference_on_gpu(window):
    bf, f64, offsets = _gpu_case(GPU_LENGTHS)
    nt = torch.tensor([0, 1, 300, 0, 0, 300, 17, 1500], device="cuda")
    got = flex_attention_jagged(*bf, offsets, num_targets=nt, window=window)
    want = jagged_attention_reference(*f64, offsets, causal=True, num_targets=nt, window=window)
    assert _rel_err(got, want) <= 2e-2
    _grads_close(got, want, bf, f64, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_varlen_matches_the_reference_where_its_mask_is_exact():
    """Causal, and at most one candidate per sequence (then a candidate sees no other candidate)."""
    bf, f64, offsets = _gpu_case(GPU_LENGTHS)
    nt = torch.tensor([0, 1, 1, 0, 1, 0, 1, 1], device="cuda")
    got = varlen_attention(*bf, offsets, num_targets=nt, max_seqlen=2000)
    want = jagged_attention_reference(*f64, offsets, causal=True, num_targets=nt)
    assert _rel_err(got, want) <= 2e-2
    _grads_close(got, want, bf, f64, 2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_varlen_applies_plain_causal_attention_with_many_candidates():
    """With several candidates per sequence it computes plain causal attention (the documented
    difference: candidates also see earlier candidates), not gemcore's target mask."""
    bf, f64, offsets = _gpu_case(GPU_LENGTHS)
    nt = torch.tensor([0, 1, 300, 0, 0, 300, 17, 1500], device="cuda")
    got = varlen_attention(*bf, offsets, num_targets=nt, max_seqlen=2000)
    causal = jagged_attention_reference(*f64, offsets, causal=True)
    targets = jagged_attention_reference(*f64, offsets, causal=True, num_targets=nt)
    assert _rel_err(got, causal) <= 2e-2 < _rel_err(got, targets)
