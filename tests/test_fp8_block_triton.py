"""Block-scaled FP8 kernels: Triton casts bit for bit against the reference, Triton and cuBLAS GEMMs
and FP8BlockLinear against float64 (relative Frobenius error <= 1e-3), with gradients.

On CPU this module only runs under TRITON_INTERPRET=1 (test_fp8_block.py starts it in a subprocess
with that set), at small sizes; the element rounding is the software path there. On a CUDA GPU it
runs at real sizes with the hardware conversion, and the cuBLAS backends (torch._scaled_mm and
torch.nn.functional.scaled_mm) are checked too. Marked gpu.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1 (run by test_fp8_block.py)"),
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
]
triton = pytest.importorskip("triton")

from gemcore.kernels import fp8_block as fb  # noqa: E402
from gemcore.kernels.fp8_block_triton import fp8_block_mm_triton  # noqa: E402
from tests.test_fp8_block import FAST_PATH_BOUND, block_data, fp8_exact_linear, partner, rel_err  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
KINDS = ["randn", "spread", "zero", "tiny"]
#: GEMM backends under test: the Triton kernel everywhere, cuBLAS on a GPU that has it
FAST = ["triton"] + (["cublas", "scaled_mm"] if CUDA else [])
CAST_SHAPES = [(130, 200), (128, 256), (1, 128), (0, 128)] if INTERPRET else \
    [(130, 200), (4096 + 17, 3072), (1, 128), (0, 128)]


def cublas_refuses(backend: str, K: int, N: int) -> bool:
    """Whether matmul='cublas' refuses a GEMM contracting K with a 128x128 operand of N rows on
    this torch."""
    return backend == "cublas" and not fb.cublas_takes_block_scales(-(-K // 128), -(-N // 128), DEVICE)


def cublas_refuses_linear(backend: str, K: int, N: int) -> bool:
    """The same for a K -> N linear: forward W (N, K) and dgrad W^T (K, N)."""
    return cublas_refuses(backend, K, N) or cublas_refuses(backend, N, K)


def on_device(x: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return x.to(dtype).to(DEVICE)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN and +-Inf in a few blocks, signed zeros, a float32 subnormal."""
    x = x.clone()
    flat = x.view(-1)
    if flat.numel() > 700:
        flat[100], flat[300], flat[600] = math.nan, math.inf, -math.inf
        flat[400] = -0.0
        flat[500] = 1e-40
    return x


def assert_same(got: fb.BlockFP8, want: fb.BlockFP8):
    assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
    assert got.block_rows == want.block_rows
    for size, g, w in zip(got.scale.shape, got.scale.stride(), want.scale.stride()):
        assert size <= 1 or got.scale.numel() == 0 or g == w, (got.scale.stride(), want.scale.stride())
    assert torch.equal(got.scale.cpu().nan_to_num(-1.0), want.scale.cpu().nan_to_num(-1.0))
    assert torch.equal(got.data.view(torch.uint8).cpu(), want.data.view(torch.uint8).cpu())


# --------------------------------------------------------------------------- casts
@pytest.mark.parametrize("shape", CAST_SHAPES)
@pytest.mark.parametrize("kind", ["randn", "spread", "zero", "tiny"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_casts_bit_exact(shape, kind, dtype):
    x = on_device(with_specials(block_data(kind, shape, seed=sum(shape))), dtype)
    assert_same(fb.quantize_rows(x, pad=True, backend="triton"), fb.quantize_rows(x.cpu(), pad=True, backend="reference"))
    got = fb.quantize_act(x, backend="triton")
    want = fb.quantize_act(x.cpu(), backend="reference")
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])


@pytest.mark.parametrize("shape", [(256, 384), (200, 130)] if INTERPRET else [(3072, 1024), (200, 130)])
@pytest.mark.parametrize("kind", ["randn", "spread", "zero"])
def test_weight_cast_bit_exact(shape, kind):
    w = on_device(with_specials(block_data(kind, shape, seed=3, rows_per_block=128)))
    got, got_t = fb.quantize_weight(w, pad=True, backend="triton")
    want, want_t = fb.quantize_weight(w.cpu(), pad=True, backend="reference")
    assert_same(got, want)
    assert_same(got_t, want_t)


def test_unpadded_rows_cast_keeps_rows():
    x = on_device(torch.randn(7, 256))
    t = fb.quantize_rows(x, backend="triton")
    assert t.data.shape == (7, 256) and t.scale.shape == (7, 2)
    assert_same(t, fb.quantize_rows(x.cpu(), backend="reference"))


# --------------------------------------------------------------------------- GEMMs
GEMM_SHAPES = [(96, 384, 256), (1, 128, 128)] if INTERPRET else [(1000, 1024, 768), (1, 128, 128), (4096, 3072, 1024)]


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("b_blocks", [1, 128])
@pytest.mark.parametrize("M,K,N", GEMM_SHAPES)
def test_fast_gemm_against_float64(backend, kind, b_blocks, M, K, N):
    a = fb.quantize_rows(on_device(block_data(kind, (M, K), seed=M + K)), pad=True)
    bx = on_device(block_data(partner(kind), (N, K), seed=N, rows_per_block=b_blocks))
    b = fb.quantize_rows(bx, pad=True) if b_blocks == 1 else fb.quantize_weight(bx, transpose=False, pad=True)[0]
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    if b_blocks == 128 and cublas_refuses(backend, K, N):
        with pytest.raises(ValueError, match="multiple of 512"):
            fb.fp8_block_mm(a, b, torch.float32, backend=backend)
        return
    got = fb.fp8_block_mm(a, b, torch.float32, backend=backend)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got, want) <= FAST_PATH_BOUND, rel_err(got, want)
    got16 = fb.fp8_block_mm(a, b, torch.bfloat16, backend=backend)
    assert got16.dtype == torch.bfloat16 and rel_err(got16, want) <= 1e-2


@pytest.mark.skipif(not INTERPRET, reason="small tiles: the interpreter's check of tile borders")
def test_triton_gemm_small_tiles_cross_borders():
    a = fb.quantize_rows(torch.randn(40, 384), pad=False)
    b = fb.quantize_weight(torch.randn(256, 384), transpose=False)[0]
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    got = fp8_block_mm_triton(a.data, a.scale, b.data, b.scale, 128, torch.float32,
                              tile=dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2, num_warps=1, num_stages=1))
    assert rel_err(got, want) <= FAST_PATH_BOUND


@pytest.mark.parametrize("backend", FAST)
def test_nan_block_propagates(backend):
    x = torch.randn(128, 256)
    x[3, 200] = math.nan
    a = fb.quantize_rows(on_device(x))
    b = fb.quantize_weight(on_device(torch.randn(128, 256)), transpose=False)[0]  # one row of blocks
    out = fb.fp8_block_mm(a, b, torch.float32, backend=backend).cpu()
    assert torch.isnan(out[3]).all() and torch.isfinite(out[torch.arange(128) != 3]).all()


# --------------------------------------------------------------------------- FP8BlockLinear
LINEAR_SHAPES = [(150, 256, 384), (1, 64, 40)] if INTERPRET else [(3000, 1024, 3072), (1, 64, 40), (517, 384, 256)]


@pytest.mark.parametrize("backend", FAST)
def test_fast_linear_on_an_empty_batch(backend):
    lin = fb.FP8BlockLinear(128, 256, matmul=backend).to(DEVICE)
    x = torch.zeros(0, 128, device=DEVICE, requires_grad=True)
    y = lin(x)
    y.sum().backward()
    assert y.shape == (0, 256) and x.grad.shape == (0, 128) and torch.all(lin.weight.grad == 0)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("M,K,N", LINEAR_SHAPES)
def test_fast_linear_against_float64(backend, kind, M, K, N):
    """Forward, dgrad and wgrad of the fast path against float64 products of the same casts."""
    x = on_device(block_data(kind, (M, K), seed=5)).requires_grad_()
    lin = fb.FP8BlockLinear(K, N, bias=False, matmul=backend, cast="triton").to(DEVICE)
    with torch.no_grad():
        lin.weight.copy_(on_device(block_data(partner(kind), (N, K), seed=6, rows_per_block=128)))
    dy = on_device(block_data(partner(kind), (M, N), seed=7))
    if cublas_refuses_linear(backend, K, N):
        with pytest.raises(ValueError, match="multiple of 512"):
            lin(x)
        return
    y = lin(x)
    y.backward(dy)
    want_y, want_dx, want_dw = fp8_exact_linear(x.detach(), lin.weight.detach(), dy)  # on the device
    assert rel_err(y, want_y) <= FAST_PATH_BOUND
    assert rel_err(x.grad, want_dx) <= FAST_PATH_BOUND
    assert rel_err(lin.weight.grad, want_dw) <= FAST_PATH_BOUND


def _on_device(t: fb.BlockFP8) -> fb.BlockFP8:
    return fb.BlockFP8(t.data.to(DEVICE), t.scale.to(DEVICE), t.block_rows)  # (strides kept)


@pytest.mark.parametrize("backend", FAST)
def test_fast_linear_triton_casts_change_nothing(backend, monkeypatch):
    """The Triton casts inside FP8BlockLinear give the CPU reference casts' bits, so forward,
    dgrad and wgrad through the same GEMM backend are identical: a wrong element in any of the six
    FP8 copies (x, x^T, W, W^T, dy, dy^T) shows here as an output or gradient that differs."""
    M, K, N = (150, 256, 384) if INTERPRET else (517, 384, 256)
    if cublas_refuses_linear(backend, K, N):  # (the refusal is tested in test_fast_linear_against_float64)
        K, N = 512, 512
    x = on_device(block_data("spread", (M, K), seed=8))
    w = on_device(block_data("spread", (N, K), seed=9, rows_per_block=128))
    dy = on_device(block_data("spread", (M, N), seed=10))

    def run():
        xi = x.clone().requires_grad_()
        lin = fb.FP8BlockLinear(K, N, bias=False, matmul=backend, cast="triton").to(DEVICE)
        with torch.no_grad():
            lin.weight.copy_(w)
        y = lin(xi)
        y.backward(dy)
        return y.detach(), xi.grad, lin.weight.grad

    got = run()
    act, weight = fb.quantize_act, fb.quantize_weight  # the layer's casts, now on the CPU reference
    monkeypatch.setattr(fb, "quantize_act", lambda t, backend: tuple(
        _on_device(q) for q in act(t.detach().cpu(), backend="reference")))
    monkeypatch.setattr(fb, "quantize_weight", lambda t, pad, backend: tuple(
        _on_device(q) for q in weight(t.detach().cpu(), pad=pad, backend="reference")))
    want = run()
    for name, g, w_ in zip(("y", "dx", "dw"), got, want):
        assert torch.equal(g, w_), (name, rel_err(g, w_))


@pytest.mark.skipif(not CUDA, reason="bf16 autocast training step on a GPU")
@pytest.mark.parametrize("backend", FAST)
def test_fast_linear_bf16_autocast_close_to_nn_linear(backend):
    torch.manual_seed(0)
    ref = torch.nn.Linear(1024, 3072).cuda()
    lin = fb.FP8BlockLinear.from_linear(ref, matmul=backend)
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    g_fp8, gx_fp8 = ref.weight.grad.clone(), x.grad.clone()
    ref.weight.grad, x.grad = None, None
    y_ref = torch.nn.functional.linear(x, ref.weight, ref.bias)
    y_ref.square().mean().backward()
    assert rel_err(y, y_ref) <= 0.05
    assert rel_err(g_fp8, ref.weight.grad) <= 0.1 and rel_err(gx_fp8, x.grad) <= 0.1


@pytest.mark.skipif(not CUDA, reason="a GPU run of the plugin")
def test_plugin_trains_on_gpu_through_fast_path():
    from gemcore.config import PrecisionConfig
    from gemcore.precision.fp8_block import make_fp8_block_policy as make_policy
    from tests.test_mx import _tiny_setup

    for backend in FAST:
        policy = make_policy(PrecisionConfig(impl="fp8_block", fp8_matmul=backend))
        model, data = _tiny_setup()
        model = policy.apply(model.cuda())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(15):
            batch = data.__getitems__(list(range(16 * (step % 4), 16 * (step % 4) + 16)))
            batch = batch.to("cuda")
            with policy.autocast("cuda"):
                loss = model.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], (backend, losses)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (compiles the cuBLAS FP8 path)")
@pytest.mark.parametrize("matmul", ["cublas", "auto"])
def test_fast_linear_compiles_as_one_graph(matmul, monkeypatch):
    """A layer moved to the GPU and then compiled whole (fullgraph: a graph break raises) computes
    what it computes eagerly: the device probes (and ``auto``'s choices) ran when it moved, not
    inside the graph. (The ``scaled_mm`` backend breaks the graph on torch 2.11, whose dynamo
    cannot trace ``torch.nn.functional.scaled_mm``.)"""
    monkeypatch.setattr(fb, "_AUTO_CHOICES", {})
    torch.manual_seed(0)
    layer = fb.FP8BlockLinear(512, 1024, matmul=matmul).cuda()
    x = torch.randn(300, 512, device="cuda", requires_grad=True)

    def step(module):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = torch.nn.functional.silu(module(x))
        y.float().square().sum().backward()
        return y.detach(), x.grad.clone(), layer.weight.grad.clone()

    want = step(layer)
    x.grad = layer.weight.grad = layer.bias.grad = None
    got = step(torch.compile(layer, fullgraph=True, dynamic=True))
    for g, w in zip(got, want):  # bf16 results: the compiled graph rounds its fused epilogue once
        assert rel_err(g, w) <= 1e-2
