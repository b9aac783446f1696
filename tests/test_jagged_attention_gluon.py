"""The Hopper (Gluon) forward of jagged self-attention.

Everywhere: which inputs it takes, and that it compiles for sm_90 with the installed Triton (no GPU
needed: Triton compiles ahead of time and ships ptxas). On an sm_90 GPU: its output and log-sum-exp
against the float64 reference, and the gradients of the full op (Triton backward over this
forward's output) when the Triton backend picks it.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gemcore.kernels.jagged_attention import jagged_attention  # noqa: E402
from gemcore.kernels import jagged_attention_gluon as gluon_attention  # noqa: E402
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def needs_hopper(test):
    """Marks a GPU test that runs on an sm_90 GPU only."""
    return pytest.mark.gpu(pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")(test))


ACTIVATIONS = ["softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "identity"]
# tile borders of the 128-row query tiles and 64-row key tiles, empty and length-1 sequences
LENGTHS = [0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 1000, 2048, 5]


def _inputs(lengths, H, D, dtype, device="cuda", seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    offsets = torch.nn.functional.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0))
    q, k, v = (torch.randn(sum(lengths), H, D, generator=g, device=device).to(dtype) for _ in range(3))
    return q, k, v, offsets


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def test_scope_names_what_it_does_not_take():
    q, k, v, offsets = _inputs([3, 5], 2, 128, torch.bfloat16, device="cpu")
    targets = torch.tensor([1, 1])

    def reason(q=q, k=k, v=v, offsets=offsets, kv_offsets=None, num_targets=None, causal=True,
               window=(-1, -1)):
        return gluon_attention.unsupported_reason(q, k, v, offsets, kv_offsets, num_targets, causal, *window)

    assert reason() is None and reason(causal=False) is None and reason(num_targets=targets) is None
    assert reason(offsets=None, kv_offsets=offsets) == "pooled attention"
    assert reason(kv_offsets=offsets, causal=False) is None
    assert reason(kv_offsets=offsets) == "causal cross attention"
    assert reason(k=k[:0], v=v[:0], kv_offsets=torch.zeros(3, dtype=torch.long), causal=False) == "no keys"
    assert reason(window=(16, -1)) == reason(window=(-1, 0)) == "a window"
    assert reason(num_targets=targets, causal=False) == "targets without causal"
    assert "dtype" in reason(q.float(), k.float(), v.float())
    assert "head dims" in reason(q[..., :96], k[..., :96], v[..., :96])
    assert "head dims" in reason(v=v[..., :64])
    # views of a fused qkv projection are taken; a head-major layout is not
    qkv = torch.zeros(8, 3, 2, 128, dtype=torch.bfloat16)
    assert reason(*qkv.unbind(1)) is None
    head_major = q.transpose(0, 1).contiguous().transpose(0, 1)
    assert reason(head_major).startswith("q's heads not packed rows")
    # on a CPU, or with the switch off, the Triton forward runs
    assert not gluon_attention.gluon_forward_applies(q, k, v, offsets, None, None, True, -1, -1, "softmax")


def test_a_part_that_fails_to_build_is_an_error_naming_its_switch(monkeypatch):
    from types import SimpleNamespace

    from triton.runtime.errors import OutOfResources

    from gemcore.kernels import jagged_attention_triton as jt

    def fails(*args):
        raise OutOfResources(240 * 1024, 227 * 1024, "shared memory")

    stub = SimpleNamespace(gluon_forward_applies=lambda *a: True, jagged_attention_fwd_hopper=fails,
                           gluon_backward_applies=lambda *a: True, jagged_attention_bwd_hopper=fails)
    monkeypatch.setattr(jt, "_hopper_modules", lambda: (stub, stub))
    for var in (jt.GLUON_SWITCH, jt.GLUON_BWD_SWITCH):
        monkeypatch.delenv(var, raising=False)
    on_gpu = SimpleNamespace(is_cuda=True)             # only the device check reads q here
    assert jt.forward_kernel(on_gpu, None, None, None) == "gluon-hopper"
    assert jt.backward_kernel(on_gpu, None, None, None) == "gluon-hopper"
    with pytest.raises(RuntimeError, match="forward failed.*OutOfResources.*shared memory.*GEMCORE_GLUON_ATTENTION=0"):
        jt._run_hopper("forward")
    with pytest.raises(RuntimeError, match="backward failed.*OutOfResources.*GEMCORE_GLUON_ATTENTION_BWD=0"):
        jt._run_hopper("backward")
    assert jt.forward_kernel(on_gpu, None, None, None) == "gluon-hopper"  # no silent switch afterwards
    # the switches are the user's explicit choice of the Triton kernels
    monkeypatch.setenv(jt.GLUON_BWD_SWITCH, "0")
    assert jt.forward_kernel(on_gpu, None, None, None) == "gluon-hopper"
    assert jt.backward_kernel(on_gpu, None, None, None) == "triton"
    monkeypatch.setenv(jt.GLUON_SWITCH, "0")
    assert jt.forward_kernel(on_gpu, None, None, None) == "triton"


def test_gluon_modules_that_do_not_load_are_an_error_naming_the_switch(monkeypatch):
    import builtins
    from types import SimpleNamespace

    from gemcore.kernels import jagged_attention_triton as jt

    real_import = builtins.__import__

    def no_gluon(name, globals=None, locals=None, fromlist=(), level=0):
        if name == "gemcore.kernels" and fromlist and "jagged_attention_gluon" in fromlist:
            raise ImportError("cannot import name 'warpgroup_mma'")
        return real_import(name, globals, locals, fromlist, level)

    monkeypatch.delenv(jt.GLUON_SWITCH, raising=False)
    jt._hopper_modules.cache_clear()
    monkeypatch.setattr(builtins, "__import__", no_gluon)
    try:
        with pytest.raises(RuntimeError, match="do not load.*warpgroup_mma.*GEMCORE_GLUON_ATTENTION=0"):
            jt.forward_kernel(SimpleNamespace(is_cuda=True), None, None, None)
        monkeypatch.setenv(jt.GLUON_SWITCH, "0")
        assert jt.forward_kernel(SimpleNamespace(is_cuda=True), None, None, None) == "triton"
    finally:
        monkeypatch.setattr(builtins, "__import__", real_import)
        jt._hopper_modules.cache_clear()


@pytest.mark.parametrize("activation,causal,dtype,head_dim,persistent,cross", [
    ("softmax", True, torch.bfloat16, 128, True, False), ("gelu", False, torch.float16, 64, True, False),
    ("silu", True, torch.bfloat16, 128, False, False), ("softmax", False, torch.bfloat16, 128, True, True),
    ("gelu_tanh", False, torch.bfloat16, 128, True, True)])
def test_compiles_for_sm90_with_the_installed_triton(activation, causal, dtype, head_dim, persistent, cross):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    block_n, stages = gluon_attention.TILES["softmax" if activation == "softmax" else "pointwise"]
    x = torch.zeros(256, 4, head_dim, dtype=dtype)
    descs = gluon_attention._descriptors(x, x, x, block_n)
    signature = {"q_desc": mangle_type(descs[0]), "k_desc": mangle_type(descs[1]),
                 "v_desc": mangle_type(descs[2]), "O": "*bf16" if dtype == torch.bfloat16 else "*fp16",
                 "LSE2": "*fp32", "kv_offsets": "*i64", "num_targets": "*i64",
                 "stride_t": "i32", "H": "i32",
                 "work": "*i32", "n_listed": "*i32", "n_seq": "i32", "qk_scale": "fp32", "inv_norm": "fp32", "STAGES": "constexpr", "ACTIVATION": "constexpr",
                 "CAUSAL": "constexpr", "HAS_TARGETS": "constexpr", "CROSS": "constexpr", "PERSISTENT": "constexpr"}
    constexprs = {"STAGES": stages, "CAUSAL": causal, "HAS_TARGETS": causal, "CROSS": cross, "PERSISTENT": persistent,
                  "ACTIVATION": gluon_attention.ACTIVATION_CODES[activation]}
    src = GluonASTSource(gluon_attention._jagged_attn_fwd_hopper, signature, constexprs=constexprs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "maxnreg": gluon_attention.MAXNREG})
    ptx = kernel.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
    assert kernel.metadata.shared <= 227 * 1024        # an H100 / H200 SM's shared memory


@needs_hopper
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_forward_matches_the_float64_reference(activation, causal, dtype, head_dim):
    q, k, v, offsets = _inputs(LENGTHS, 4, head_dim, dtype)
    scale, max_len = head_dim ** -0.5, max(LENGTHS)
    out, lse2 = gluon_attention.jagged_attention_fwd_hopper(
        q, k, v, offsets, activation, causal, scale, 1.0 / max_len, max_len)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=causal,
                                      activation=activation)
    assert out.dtype == dtype and out.shape == q.shape
    assert _rel_err(out, want) < 1e-2, _rel_err(out, want)
    if activation == "softmax":                        # base-2 log-sum-exp of the scaled scores
        scores = torch.zeros(q.shape[0], 4, dtype=torch.float64, device="cuda")
        for b in range(len(LENGTHS)):
            s, e = int(offsets[b]), int(offsets[b + 1])
            qk = torch.einsum("ihd,jhd->hij", q[s:e].double(), k[s:e].double()) * scale
            if causal:
                qk = qk.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool, device="cuda").triu(1),
                                    float("-inf"))
            scores[s:e] = torch.logsumexp(qk, -1).T / torch.log(torch.tensor(2.0, dtype=torch.float64))
        assert torch.allclose(lse2.double(), scores, atol=2e-2, rtol=0)
    else:
        assert lse2.numel() == 0


@needs_hopper
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_the_triton_backend_takes_it_and_gradients_match(activation, monkeypatch):
    calls = []
    real = gluon_attention.jagged_attention_fwd_hopper
    monkeypatch.setattr(gluon_attention, "jagged_attention_fwd_hopper",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    lengths = [2048, 1500, 700, 1, 0, 129]             # mean above MIN_MEAN_LEN
    q, k, v, offsets = _inputs(lengths, 4, 128, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    kw = dict(activation=activation, causal=True)
    got = jagged_attention(q, k, v, offsets, backend="triton", **kw)
    assert calls, "the Triton backend did not pick the Hopper forward"
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = jagged_attention_reference(q64, k64, v64, offsets, **kw)
    assert _rel_err(got, want) < 1e-2
    grad = torch.randn_like(want)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), grad.to(got.dtype)),
                          torch.autograd.grad(want, (q64, k64, v64), grad)):
        assert _rel_err(a, b) < 2e-2, ("d" + name, _rel_err(a, b))
    monkeypatch.setenv("GEMCORE_GLUON_ATTENTION", "0")
    calls.clear()
    jagged_attention(q, k, v, offsets, backend="triton", **kw)
    assert not calls


@needs_hopper
@pytest.mark.parametrize("tile", sorted(set(gluon_attention.TILES.values())))
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_every_tile_in_use_is_right_for_both_kinds(tile, activation):
    q, k, v, offsets = _inputs(LENGTHS, 2, 128, torch.bfloat16, seed=1)
    block_n, stages = tile
    out, _ = gluon_attention.jagged_attention_fwd_hopper(
        q, k, v, offsets, activation, True, 128 ** -0.5, 1.0 / 2048, 2048, block_n=block_n, stages=stages)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=True,
                                      activation=activation)
    assert _rel_err(out, want) < 1e-2


@needs_hopper
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_targets_and_fused_qkv_views(activation):
    """Candidates (the last n tokens of a sequence; one sequence all candidates) on views of a
    fused qkv projection, as the model calls it. The last two have short histories, so a
    candidate's own key (past the history, in a later key tile) weighs in its row."""
    lengths = [300, 1, 129, 0, 2048, 64, 5, 131, 260]
    targets = torch.tensor([30, 1, 0, 0, 200, 64, 5, 43, 250], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 4, 128, generator=g, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    offsets = torch.nn.functional.pad(torch.tensor(lengths, device="cuda").cumsum(0), (1, 0))
    assert gluon_attention.unsupported_reason(q, k, v, offsets, None, targets, True, -1, -1) is None
    out, _ = gluon_attention.jagged_attention_fwd_hopper(
        q, k, v, offsets, activation, True, 128 ** -0.5, 1.0 / 2048, 2048, targets)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=True,
                                      activation=activation, num_targets=targets)
    assert _rel_err(out, want) < 1e-2, _rel_err(out, want)


@needs_hopper
@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=8),
       activation=st.sampled_from(ACTIVATIONS), causal=st.booleans(), targets=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hypothesis_lengths(lengths, activation, causal, targets, seed):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    q, k, v, offsets = _inputs(lengths, 2, 128, torch.bfloat16, seed=seed)
    num_targets = None
    if targets and causal:
        num_targets = torch.tensor([n // 3 for n in lengths], device="cuda")
    max_len = max(lengths)
    out, _ = gluon_attention.jagged_attention_fwd_hopper(
        q, k, v, offsets, activation, causal, 128 ** -0.5, 1.0 / max_len, max_len, num_targets)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), offsets, causal=causal,
                                      activation=activation, num_targets=num_targets)
    assert _rel_err(out, want) < 1e-2, _rel_err(out, want)


def _cross_inputs(q_lengths, kv_lengths, H, D, dtype, seed=3):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q_off, kv_off = (torch.nn.functional.pad(torch.tensor(n, device="cuda").cumsum(0), (1, 0))
                     for n in (q_lengths, kv_lengths))
    q = torch.randn(sum(q_lengths), H, D, generator=g, device="cuda").to(dtype)
    k, v = (torch.randn(sum(kv_lengths), H, D, generator=g, device="cuda").to(dtype) for _ in range(2))
    return q, k, v, q_off, kv_off


@needs_hopper
@pytest.mark.parametrize("activation", ["softmax", "gelu_tanh", "silu"])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_cross_attention_matches_the_float64_reference(activation, dtype, head_dim):
    """q sequence b against kv sequence b: empty q and empty kv sequences, kv lengths on the
    key-tile borders."""
    q_lengths = [0, 1, 129, 300, 64, 700, 5, 128]
    kv_lengths = [3, 0, 256, 1, 300, 0, 64, 65]
    q, k, v, q_off, kv_off = _cross_inputs(q_lengths, kv_lengths, 4, head_dim, dtype)
    assert gluon_attention.unsupported_reason(q, k, v, q_off, kv_off, None, False, -1, -1) is None
    max_len = max(q_lengths + kv_lengths)
    out, lse2 = gluon_attention.jagged_attention_fwd_hopper(
        q, k, v, q_off, activation, False, head_dim ** -0.5, 1.0 / max_len, max_len, kv_offsets=kv_off)
    want = jagged_attention_reference(q.double(), k.double(), v.double(), q_off, kv_offsets=kv_off,
                                      activation=activation, norm=None if activation == "softmax" else max_len)
    assert _rel_err(out, want) < 1e-2, _rel_err(out, want)
    no_keys = torch.cat([torch.full((n,), m == 0, device="cuda") for n, m in zip(q_lengths, kv_lengths)])
    assert out[no_keys].abs().max() == 0                     # rows without keys: zeros
    if activation == "softmax":
        assert torch.isinf(lse2[no_keys]).all() and (lse2[no_keys] > 0).all()   # as the Triton forward
        assert torch.isfinite(lse2[~no_keys]).all()


@needs_hopper
def test_cross_attention_through_the_backend_with_the_triton_backward(monkeypatch):
    calls = []
    real = gluon_attention.jagged_attention_fwd_hopper
    monkeypatch.setattr(gluon_attention, "jagged_attention_fwd_hopper",
                        lambda *a, **kw: calls.append(kw.get("kv_offsets")) or real(*a, **kw))
    q_lengths, kv_lengths = [900, 600, 0, 1000, 257], [256, 0, 256, 256, 3]   # mean 551: above MIN_MEAN_LEN
    q, k, v, q_off, kv_off = _cross_inputs(q_lengths, kv_lengths, 4, 128, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    got = jagged_attention(q, k, v, q_off, kv_offsets=kv_off, activation="gelu_tanh", backend="triton")
    assert calls and calls[0] is not None, "the Triton backend did not give cross attention to the Gluon forward"
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = jagged_attention_reference(q64, k64, v64, q_off, kv_offsets=kv_off, activation="gelu_tanh")
    assert _rel_err(got, want) < 1e-2
    grad = torch.randn_like(want)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), grad.to(got.dtype)),
                          torch.autograd.grad(want, (q64, k64, v64), grad)):
        assert _rel_err(a, b) < 2e-2, ("d" + name, _rel_err(a, b))
