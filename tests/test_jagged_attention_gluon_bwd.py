"""The Hopper (Gluon) backward of jagged self-attention.

Everywhere: that both kernels compile for sm_90 with the installed Triton (no GPU needed) and when
the Triton backend takes them. On an sm_90 GPU: dq, dk, dv against float64 autograd, for every
activation, causal or full, with targets, on views of a fused qkv projection, on random lengths;
and through the Triton backend, against the Triton backward.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gemcore.kernels.jagged_attention import jagged_attention  # noqa: E402
from gemcore.kernels import jagged_attention_gluon_bwd as gluon_bwd  # noqa: E402
from gemcore.kernels.jagged_attention_gluon import MAXNREG, jagged_attention_fwd_hopper  # noqa: E402
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference  # noqa: E402
from gemcore.kernels.jagged_attention_triton import backward_kernel  # noqa: E402
from gemcore.kernels.jagged_attention_triton_common import ACTIVATION_CODES  # noqa: E402

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def needs_hopper(test):
    """Marks a GPU test that runs on an sm_90 GPU only."""
    return pytest.mark.gpu(pytest.mark.skipif(not HOPPER, reason="needs an sm_90 GPU (H100 / H200)")(test))


ACTIVATIONS = list(ACTIVATION_CODES)
# the 64- and 128-row tile borders of both kernels, empty and length-1 sequences
LENGTHS = [0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 1000, 2048, 5]


def _rel_err(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _offsets(lengths, device="cuda"):
    return torch.nn.functional.pad(torch.tensor(lengths, device=device).cumsum(0), (1, 0))


def _check_gradients(q, k, v, offsets, activation, causal, num_targets=None, do=None, tol=2e-2):
    """The Gluon forward then backward against float64 autograd of the reference."""
    D, max_len = q.shape[2], int((offsets[1:] - offsets[:-1]).max())
    scale = D ** -0.5
    out, lse2 = jagged_attention_fwd_hopper(q, k, v, offsets, activation, causal, scale, 1.0 / max_len, max_len,
                                            num_targets)
    if do is None:
        do = torch.randn_like(out)
    dq, dk, dv = gluon_bwd.jagged_attention_bwd_hopper(do, q, k, v, out, lse2, offsets, activation, causal, scale,
                                                       1.0 / max_len, max_len, num_targets)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    want = jagged_attention_reference(q64, k64, v64, offsets, causal=causal, activation=activation,
                                      num_targets=num_targets)
    wants = torch.autograd.grad(want, (q64, k64, v64), do.double())
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), wants):
        assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
        # relative, with a floor: a batch of length-1 sequences has dq = 0 exactly (softmax over one
        # key), which the kernel meets only to float32 rounding of dP − delta
        err = float((got.double() - ref).norm())
        assert err <= tol * float(ref.norm()) + 1e-4 * got.numel() ** 0.5, (name, err, float(ref.norm()))


@pytest.mark.parametrize("activation,causal,targets,dtype,head_dim,persistent", [
    ("softmax", True, True, torch.bfloat16, 128, True), ("silu", True, False, torch.bfloat16, 128, True),
    ("gelu", False, False, torch.float16, 64, True), ("softmax", True, False, torch.bfloat16, 128, False)])
def test_compiles_for_sm90_with_the_installed_triton(activation, causal, targets, dtype, head_dim, persistent):
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    x = torch.zeros(256, 4, head_dim, dtype=dtype)
    ptr = "*bf16" if dtype == torch.bfloat16 else "*fp16"
    flags = {"ACTIVATION": ACTIVATION_CODES[activation], "CAUSAL": causal, "HAS_TARGETS": targets,
             "PERSISTENT": persistent}
    scalars = {"scale": "fp32", "qk_scale": "fp32", "inv_norm": "fp32", "STAGES": "constexpr",
               "ACTIVATION": "constexpr", "CAUSAL": "constexpr", "HAS_TARGETS": "constexpr",
               "PERSISTENT": "constexpr"}
    rows, slot, dq_stages = gluon_bwd.DQ_TILE
    dq_descs = [gluon_bwd.descriptor(x, r) for r in (rows // 2, rows // 2, slot, slot)]
    dq_signature = dict(zip(("q_desc", "do_desc", "k_desc", "v_desc"), map(mangle_type, dq_descs)),
                        DQ=ptr, O=ptr, LSE2="*fp32", DELTA="*fp32", num_targets="*i64",
                        stride_t="i32", stride_o="i32", H="i32", work="*i32", n_listed="*i32", n_seq="i32", **scalars)
    rows, slot, dkdv_stages = gluon_bwd.DKDV_TILE
    dkdv_descs = [gluon_bwd.descriptor(x, r) for r in (rows // 2, rows // 2, slot, slot)]
    dkdv_signature = dict(zip(("k_desc", "v_desc", "q_desc", "do_desc"), map(mangle_type, dkdv_descs)),
                          DK=ptr, DV=ptr, LSE2="*fp32", DELTA="*fp32", num_targets="*i64",
                          stride_t="i32", H="i32", work="*i32", n_listed="*i32", n_seq="i32", **scalars)
    for kernel, signature, stages in ((gluon_bwd._jagged_attn_bwd_dq_hopper, dq_signature, dq_stages),
                                      (gluon_bwd._jagged_attn_bwd_dkdv_hopper, dkdv_signature, dkdv_stages)):
        src = GluonASTSource(kernel, signature, constexprs=dict(flags, STAGES=stages))
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4, "maxnreg": MAXNREG})
        ptx = compiled.asm["ptx"]
        assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        assert compiled.metadata.shared <= 227 * 1024        # an H100 / H200 SM's shared memory


@pytest.mark.parametrize("dq_slot,dkdv_slot", [(64, 64), (128, 64), (64, 128)])
def test_the_launches_share_descriptors_and_get_the_right_ones(monkeypatch, dq_slot, dkdv_slot):
    """No GPU needed (the launches are recorded, not run): one descriptor per tensor and block
    shape, and each kernel gets q, do, k and v in the blocks its tile reads."""
    built, launches = [], {}
    names = {}

    def descriptor(t, rows):
        built.append((names[t.data_ptr()], rows))
        return (names[t.data_ptr()], rows)

    class Recorder:
        def __init__(self, name):
            self.name = name

        def launch(self, grid, args, meta, options):
            launches[self.name] = args[:4]

    monkeypatch.setattr(gluon_bwd, "descriptor", descriptor)
    monkeypatch.setattr(gluon_bwd, "_DQ_LAUNCHES", Recorder("dq"))
    monkeypatch.setattr(gluon_bwd, "_DKDV_LAUNCHES", Recorder("dkdv"))
    monkeypatch.setattr(gluon_bwd, "cached_lists", lambda *a, **k: [(None, None), (None, None)])
    monkeypatch.setattr(gluon_bwd, "sm_count", lambda device: 132)
    monkeypatch.setattr(gluon_bwd, "DQ_TILE", (128, dq_slot, 3))
    monkeypatch.setattr(gluon_bwd, "DKDV_TILE", (128, dkdv_slot, 2))
    q, k, v, do, out = (torch.zeros(256, 2, 128, dtype=torch.bfloat16) for _ in range(5))
    names.update({t.data_ptr(): n for n, t in zip("qkvdo", (q, k, v, do))})
    lse2 = torch.zeros(256, 2)
    gluon_bwd.jagged_attention_bwd_hopper(do, q, k, v, out, lse2, torch.tensor([0, 256]), "softmax", True,
                                          0.1, 1.0, 256)
    assert sorted(built) == sorted({(n, rows) for n in "qdkv" for rows in {64, dq_slot, dkdv_slot}})
    assert launches["dq"] == (("q", 64), ("d", 64), ("k", dq_slot), ("v", dq_slot))
    assert launches["dkdv"] == (("k", 64), ("v", 64), ("q", dkdv_slot), ("d", dkdv_slot))


def test_the_backend_takes_it_only_on_hopper_and_when_switched_on(monkeypatch):
    q = torch.zeros(4096, 2, 128, dtype=torch.bfloat16)
    offsets = torch.tensor([0, 2048, 4096])
    assert backward_kernel(q, q, q, offsets) == "triton"               # on a CPU
    assert not gluon_bwd.gluon_backward_applies(q, q, q, offsets, None, None, True, -1, -1)
    if HOPPER:
        on_gpu, off_gpu = q.cuda(), offsets.cuda()
        assert backward_kernel(on_gpu, on_gpu, on_gpu, off_gpu) == "gluon-hopper"
        for switch in ("GEMCORE_GLUON_ATTENTION", "GEMCORE_GLUON_ATTENTION_BWD"):
            with monkeypatch.context() as patch:
                patch.setenv(switch, "0")
                assert backward_kernel(on_gpu, on_gpu, on_gpu, off_gpu) == "triton"
        short = torch.tensor([0, 10, 20], device="cuda")        # mean length below MIN_MEAN_LEN
        assert backward_kernel(on_gpu[:20], on_gpu[:20], on_gpu[:20], short) == "triton"


@needs_hopper
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_gradients_match_float64_autograd(activation, causal, dtype, head_dim):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(sum(LENGTHS), 4, head_dim, generator=g, device="cuda").to(dtype) for _ in range(3))
    _check_gradients(q, k, v, _offsets(LENGTHS), activation, causal)


@needs_hopper
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_targets_fused_qkv_views_and_a_strided_output_gradient(activation):
    """Candidates (one sequence all candidates, two with short histories) on views of a fused qkv
    projection; dO a view with a padded row stride, as a later slice may hand it back."""
    lengths = [300, 1, 129, 0, 2048, 64, 5, 131, 260]
    targets = torch.tensor([30, 1, 0, 0, 200, 64, 5, 43, 250], device="cuda")
    g = torch.Generator(device="cuda").manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 4, 128, generator=g, device="cuda").to(torch.bfloat16)
    q, k, v = qkv.unbind(1)
    do = torch.randn(sum(lengths), 4, 136, generator=g, device="cuda").to(torch.bfloat16)[..., :128]
    _check_gradients(q, k, v, _offsets(lengths), activation, True, targets, do)


@needs_hopper
@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=8),
       activation=st.sampled_from(ACTIVATIONS), causal=st.booleans(), targets=st.booleans(),
       seed=st.integers(0, 2**16))
def test_hypothesis_lengths(lengths, activation, causal, targets, seed):
    if sum(lengths) == 0:
        lengths = lengths + [1]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(sum(lengths), 2, 128, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    num_targets = torch.tensor([n // 3 for n in lengths], device="cuda") if targets and causal else None
    _check_gradients(q, k, v, _offsets(lengths), activation, causal, num_targets)


@needs_hopper
@pytest.mark.parametrize("activation", ["softmax", "gelu_tanh"])
def test_the_triton_backend_runs_it_and_agrees_with_the_triton_backward(activation, monkeypatch):
    calls = []
    real = gluon_bwd.jagged_attention_bwd_hopper
    monkeypatch.setattr(gluon_bwd, "jagged_attention_bwd_hopper", lambda *a: calls.append(1) or real(*a))
    lengths = [2048, 1500, 700, 1, 0, 129]
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 4, 128, generator=g, device="cuda").to(torch.bfloat16).requires_grad_()
               for _ in range(3))
    offsets = _offsets(lengths)
    out = jagged_attention(q, k, v, offsets, activation=activation, causal=True, backend="triton")
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), do)
    assert calls, "the Triton backend did not pick the Hopper backward"
    monkeypatch.setenv("GEMCORE_GLUON_ATTENTION_BWD", "0")
    out = jagged_attention(q, k, v, offsets, activation=activation, causal=True, backend="triton")
    for name, a, b in zip(("dq", "dk", "dv"), grads, torch.autograd.grad(out, (q, k, v), do)):
        assert _rel_err(a, b) < 1e-2, (name, _rel_err(a, b))
    assert len(calls) == 1

