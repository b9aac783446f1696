"""Jagged attention: the reference against an independent float64 loop, input validation, the
``jfa`` / ``gdpa`` plugin, the model training with them on CPU, and (in a subprocess with
TRITON_INTERPRET=1) the Triton kernels on CPU."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.kernels.jagged_attention import jagged_attention
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference

ACTS = ["softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "identity"]


# --------------------------------------------------------------------------- independent loop
def _act64(name: str, x: torch.Tensor) -> torch.Tensor:
    """Activations written from their formulas, not from torch.nn.functional."""
    if name == "silu":
        return x / (1 + torch.exp(-x))
    if name == "gelu":
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    if name == "gelu_tanh":
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    if name == "relu":
        return x * (x > 0)
    if name == "relu2":
        return (x * (x > 0)) ** 2
    return x


def _visible(i, j, lq, causal, n_targets, window) -> bool:
    if causal and j > i:
        return False
    if causal and n_targets and j >= lq - n_targets and j != i:
        return False
    if window is not None:
        left, right = window
        pos = min(i, lq - n_targets) if causal and n_targets else i  # candidates at the history's end
        if left is not None and left >= 0 and pos - j > left:
            return False
        if right is not None and right >= 0 and j - i > right:
            return False
    return True


def loop_attention(q, k, v, offsets, kv_offsets=None, activation="softmax", causal=False,
                   scale=None, norm=None, num_targets=None, window=None):
    """One query row at a time, in float64, with the visibility rules spelled out."""
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    kvo = (offsets if kv_offsets is None else kv_offsets).tolist()
    qo = offsets.tolist() if offsets is not None else None
    if norm is None:
        lens = [b - a for a, b in zip(kvo, kvo[1:])] + ([b - a for a, b in zip(qo, qo[1:])] if qo else [])
        norm = max(max(lens, default=0), 1)
    rows = []
    for b in range(len(kvo) - 1):
        kb, vb = k[kvo[b]:kvo[b + 1]], v[kvo[b]:kvo[b + 1]]
        qb = q if qo is None else q[qo[b]:qo[b + 1]]
        n_t = int(num_targets[b]) if num_targets is not None else 0
        for i in range(qb.shape[0]):
            js = [j for j in range(kb.shape[0]) if _visible(i, j, qb.shape[0], causal, n_t, window)]
            if not js:
                rows.append(q.new_zeros(1, q.shape[1], v.shape[-1]))
                continue
            s = (qb[i][None] * kb[js]).sum(-1) * scale  # (J, H)
            w = torch.softmax(s, dim=0) if activation == "softmax" else _act64(activation, s) / norm
            rows.append((w[:, :, None] * vb[js]).sum(0, keepdim=True))
    out = torch.cat(rows) if rows else q.new_zeros(0, q.shape[1], v.shape[-1])
    if offsets is None:
        return out.view(len(kvo) - 1, q.shape[0], q.shape[1], v.shape[-1])
    return out


def _offsets(lengths) -> torch.Tensor:
    return torch.tensor([0] + list(torch.tensor(lengths, dtype=torch.int64).cumsum(0)), dtype=torch.int64)


def _case(draw_lengths, kv_lengths, mode, H=2, D=4, Dv=3, dtype=torch.float64, nq=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    offsets = _offsets(draw_lengths)
    kv_offsets = _offsets(kv_lengths) if mode in ("cross", "pma") else None
    tq = nq if mode == "pma" else int(offsets[-1])
    tk = int((kv_offsets if kv_offsets is not None else offsets)[-1])
    q = torch.randn(tq, H, D, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(tk, H, D, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(tk, H, Dv, generator=g, dtype=dtype).requires_grad_()
    return q, k, v, (None if mode == "pma" else offsets), kv_offsets


def _grads(out, inputs, seed=1):
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    if not out.requires_grad:  # nothing visible anywhere: every gradient is zero
        return [None] * len(inputs)
    return torch.autograd.grad(out, inputs, g, allow_unused=True)


@settings(max_examples=80, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=1, max_size=4),
    kv_extra=st.lists(st.integers(0, 9), min_size=4, max_size=4),
    activation=st.sampled_from(ACTS),
    mode=st.sampled_from(["self", "causal", "targets", "cross", "pma"]),
    window=st.sampled_from([None, (2, 0), (1, 3), (None, 2), (0, 0)]),
    seed=st.integers(0, 2 ** 16),
)
def test_reference_matches_float64_loop(lengths, kv_extra, activation, mode, window, seed):
    kv_lengths = kv_extra[:len(lengths)]
    q, k, v, offsets, kv_offsets = _case(lengths, kv_lengths, mode, seed=seed)
    causal = mode in ("causal", "targets")
    targets = None
    if mode == "targets":
        targets = torch.tensor([(seed >> b) % (n + 1) for b, n in enumerate(lengths)], dtype=torch.int64)
    kw = dict(kv_offsets=kv_offsets, activation=activation, causal=causal, num_targets=targets,
              window=window)
    ref = jagged_attention_reference(q, k, v, offsets, **kw)
    want = loop_attention(q, k, v, offsets, **kw)
    assert ref.shape == want.shape
    torch.testing.assert_close(ref, want, rtol=1e-9, atol=1e-9)
    if ref.numel():
        for a, b in zip(_grads(ref, (q, k, v), seed), _grads(want, (q, k, v), seed)):
            torch.testing.assert_close(a if a is not None else torch.zeros_like(b),
                                       b if b is not None else torch.zeros_like(a), rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------- HSTU's target rule
def hstu_valid_mask(L: int, n: int, max_attn_len: int) -> torch.Tensor:
    """(L, L) bool, element by element from generative-recommenders' ``pytorch_hstu_mha`` rule:
    positions clamped to the history's end ``L - n``; row r sees column c when r == c or the
    clamped distance is positive, and (``max_attn_len > 0``) at most ``max_attn_len``."""
    mask = torch.zeros(L, L, dtype=torch.bool)
    for r in range(L):
        for c in range(L):
            dist = min(r, L - n) - min(c, L - n)
            ok = r == c or dist > 0
            if max_attn_len > 0:
                ok = ok and dist <= max_attn_len
            mask[r, c] = ok
    return mask


def _hstu_window(w: int, right):
    return None if w == 0 else (w, right)


def test_target_window_example_from_hstu():
    """L=3, 2 candidates, window 1: the last candidate sees the last history item and itself."""
    from gemcore.kernels.jagged_attention_reference import allowed_mask

    got = allowed_mask(3, 3, causal=True, n_targets=2, window=(1, 0), device="cpu")
    assert got[2].tolist() == [True, False, True]
    assert torch.equal(got, hstu_valid_mask(3, 2, 1))


@pytest.mark.parametrize("right", [None, 0])
def test_mask_matches_hstu_rule(right):
    """Every L <= 9, every number of candidates 0..L and every window 0 (none) .. L + 1."""
    from gemcore.kernels.jagged_attention_reference import allowed_mask

    for L in range(10):
        for n in range(L + 1):
            for w in range(L + 2):
                got = allowed_mask(L, L, causal=True, n_targets=n, window=_hstu_window(w, right),
                                   device="cpu")
                assert torch.equal(got, hstu_valid_mask(L, n, w)), (L, n, w)


def _dense_hstu_attention(q, k, v, lengths, targets, w, activation, norm):
    """Float64 attention of each sequence under :func:`hstu_valid_mask`, dense per sequence."""
    outs, start = [], 0
    for L, n in zip(lengths, targets):
        qb, kb, vb = (t[start:start + L].double() for t in (q, k, v))
        start += L
        s = torch.einsum("ihd,jhd->hij", qb, kb) / math.sqrt(q.shape[-1])
        allowed = hstu_valid_mask(L, n, w)
        if activation == "softmax":
            p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        else:
            p = _act64(activation, s) * allowed / norm
        outs.append(torch.einsum("hij,jhd->ihd", p, vb))
    return torch.cat(outs)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("w", [0, 1, 2, 5])
def test_reference_matches_dense_hstu_attention(activation, w):
    """Output and gradients of the reference with targets and a window against dense float64
    attention under HSTU's mask; empty and length-1 sequences, no candidates and all candidates."""
    lengths = [0, 1, 1, 7, 9, 4, 12]
    targets = [0, 0, 1, 3, 0, 4, 8]
    g = torch.Generator().manual_seed(w)
    T = sum(lengths)
    q, k, v = (torch.randn(T, 2, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    offsets = _offsets(lengths)
    got = jagged_attention_reference(q, k, v, offsets, activation=activation, causal=True,
                                     num_targets=torch.tensor(targets), window=_hstu_window(w, 0))
    want = _dense_hstu_attention(q, k, v, lengths, targets, w, activation, norm=max(lengths))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    for a, b in zip(_grads(got, (q, k, v)), _grads(want, (q, k, v))):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_reference_scale_norm_and_max_seqlen():
    q, k, v, offsets, _ = _case([5, 0, 3], [], "self", seed=3)
    got = jagged_attention_reference(q, k, v, offsets, activation="silu", causal=True, scale=0.3, norm=7.0)
    want = loop_attention(q, k, v, offsets, activation="silu", causal=True, scale=0.3, norm=7.0)
    torch.testing.assert_close(got, want)
    # default norm = max_seqlen when given, else the longest sequence (5)
    by_max = jagged_attention_reference(q, k, v, offsets, activation="silu", causal=True, max_seqlen=10)
    by_len = jagged_attention_reference(q, k, v, offsets, activation="silu", causal=True)
    torch.testing.assert_close(by_max * 10, by_len * 5)


def test_softmax_row_without_keys_is_zero():
    q, k, v, offsets, kv_offsets = _case([3, 2], [0, 1], "cross", dtype=torch.float32)
    out = jagged_attention(q, k, v, offsets, kv_offsets=kv_offsets, window=(0, 0))
    # first sequence has no keys; second: only query 0 sees key 0 (|i - j| <= 0)
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.equal(out[4], torch.zeros_like(out[4]))
    torch.testing.assert_close(out[3], v[0].detach())


# --------------------------------------------------------------------------- validation
def _good():
    q, k, v, offsets, _ = _case([3, 2], [], "self", dtype=torch.float32)
    return dict(q=q, k=k, v=v, offsets=offsets)


@pytest.mark.parametrize("change, name", [
    (lambda a: a.update(offsets=torch.tensor([1, 3, 5])), "offsets"),
    (lambda a: a.update(offsets=torch.tensor([0, 4, 3, 5])), "offsets"),
    (lambda a: a.update(offsets=torch.tensor([0, 3, 4])), "offsets"),
    (lambda a: a.update(offsets=torch.tensor([0.0, 3.0, 5.0])), "offsets"),
    (lambda a: a.update(offsets=torch.tensor([[0, 3, 5]])), "offsets"),
    (lambda a: a.update(q=a["q"][:, :, :3]), "head dim"),
    (lambda a: a.update(k=a["k"][:, :1]), "heads"),
    (lambda a: a.update(v=a["v"].double()), "v must be"),
    (lambda a: a.update(k=a["k"].half()), "dtype"),
    (lambda a: a.update(q=a["q"][0]), "q must be"),
    (lambda a: a.update(v=a["v"][:4]), "v has"),
    (lambda a: a.update(activation="tanh"), "activation"),
    (lambda a: a.update(backend="cuda"), "backend"),
    (lambda a: a.update(num_targets=torch.tensor([1, 1])), "num_targets"),  # not causal
    (lambda a: a.update(causal=True, num_targets=torch.tensor([4, 1])), "num_targets"),
    (lambda a: a.update(causal=True, num_targets=torch.tensor([-1, 1])), "num_targets"),
    (lambda a: a.update(causal=True, num_targets=torch.tensor([1])), "num_targets"),
    (lambda a: a.update(causal=True, kv_offsets=torch.tensor([0, 3, 5])), "causal"),
    (lambda a: a.update(kv_offsets=torch.tensor([0, 5])), "kv_offsets"),
    (lambda a: a.update(kv_offsets=torch.tensor([0, 2, 4])), "kv_offsets"),
    (lambda a: a.update(offsets=None), "kv_offsets"),
    (lambda a: a.update(window=(1,)), "window"),
    (lambda a: a.update(norm=2.0), "norm"),
    (lambda a: a.update(activation="silu", norm=-1.0), "norm"),
    (lambda a: a.update(max_seqlen=2), "max_seqlen"),
    (lambda a: a.update(max_seqlen=-3), "max_seqlen"),
])
def test_bad_input_raises_value_error_naming_argument(change, name):
    args = _good()
    change(args)
    q, k, v, offsets = args.pop("q"), args.pop("k"), args.pop("v"), args.pop("offsets")
    with pytest.raises(ValueError, match=name):
        jagged_attention(q, k, v, offsets, **args)


def test_pma_shape_and_empty_batch():
    q, k, v, _, kv_offsets = _case([1], [4, 0, 2], "pma", dtype=torch.float32, nq=2)
    out = jagged_attention(q, k, v, None, kv_offsets=kv_offsets[:4])
    assert out.shape == (3, 2, 2, 3)
    empty = jagged_attention(q[:0], k[:0], v[:0], torch.zeros(1, dtype=torch.int64))
    assert empty.shape == (0, 2, 3)


# --------------------------------------------------------------------------- plugin and model
def _manager():
    from gemcore.plugin_manager import GemPluginManager
    from gemcore.plugins import attention_jagged

    manager = GemPluginManager()
    manager.register(attention_jagged, name="attention_jagged")
    return manager


@pytest.mark.parametrize("impl, config_act, expected", [
    ("jfa", "silu", "softmax"), ("gdpa", "softmax", "silu"), ("gdpa", "gelu_tanh", "gelu_tanh"),
    ("auto", "softmax", "softmax"), ("auto", "silu", "silu")])
def test_plugin_factories_pick_activation(impl, config_act, expected):
    attn = _manager().resolve("attention", impl).factory(AttentionConfig(activation=config_act))
    q, k, v, offsets, _ = _case([4, 1, 0], [], "self", dtype=torch.float32)
    targets = torch.tensor([1, 0, 0])
    got = attn(q, k, v, offsets, causal=True, num_targets=targets, max_seqlen=6)
    want = jagged_attention_reference(q, k, v, offsets, activation=expected, causal=True,
                                      num_targets=targets, max_seqlen=6)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_auto_is_the_reference_on_cpu_and_the_triton_kernels_on_cuda(device, activation):
    """The default implementation: the reference's function bit for bit on a CPU tensor, the
    Triton kernels' on a CUDA tensor (whose output differs from the reference by rounding)."""
    from gemcore.kernels.jagged_attention import make_attention

    config = AttentionConfig(activation=activation)
    auto = _manager().resolve("attention", "auto").factory(config)
    q, k, v, offsets, _ = _case([5, 1, 0, 3], [], "self", D=16, Dv=16, dtype=torch.float32)
    q, k, v, offsets = (t.to(device) for t in (q, k, v, offsets))
    targets = torch.tensor([2, 1, 0, 0], device=device)
    got = auto(q, k, v, offsets, causal=True, num_targets=targets, max_seqlen=5)
    want = make_attention(config, backend="triton" if device == "cuda" else "reference")(
        q, k, v, offsets, causal=True, num_targets=targets, max_seqlen=5)
    assert torch.equal(got, want)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
@pytest.mark.parametrize("impl", ["auto", "jfa", "gdpa"])
def test_model_trains_with_jagged_attention(impl, device):
    from gemcore.data import make_synthetic
    from gemcore.model import GemModel

    torch.manual_seed(0)
    cfg = ModelConfig(num_items=64, hidden=16, num_blocks=1, num_heads=2)
    data = make_synthetic(num_users=16, num_items=64, num_actions=4, max_len=12, num_candidates=2,
                          num_clusters=4, kind="uniform", seed=0)
    batch = data.__getitems__(list(range(16)))
    batch = batch.to(device)
    model = GemModel(cfg, _manager().resolve("attention", impl).factory(AttentionConfig())).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- Triton on CPU
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="CPU-only machines check the kernels in the interpreter; with a GPU, "
                           "test_jagged_attention_triton.py runs them compiled (and Triton 3.6's "
                           "interpreter, the GPU machine's, cannot run them: 'only 0-dimensional "
                           "arrays can be converted to Python scalars')")
def test_triton_kernels_in_interpreter_subprocess():
    """Runs test_jagged_attention_triton.py with TRITON_INTERPRET=1 (which must be set before
    triton is imported, so in a fresh process)."""
    pytest.importorskip("triton")
    here = Path(__file__).parent
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
         str(here / "test_jagged_attention_triton.py")],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout, proc.stdout[-2000:]
