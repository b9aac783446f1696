"""Triton MX kernels against the PyTorch reference: casts bit for bit, GEMMs against float64.

On CPU this module only runs under TRITON_INTERPRET=1 (test_mx.py starts it in a subprocess with
that set), at small sizes with small tiles pinned so every path crosses tile borders; the element
rounding is the software path there (the interpreter's own FP8 casts do not round to nearest
even). On a CUDA GPU it runs at real sizes with the default tiles and both rounding paths.
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
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1 (run by test_mx.py)"),
    # NaN blocks' discarded element arithmetic casts NaN to int in the interpreter's NumPy
    pytest.mark.filterwarnings("ignore:invalid value encountered in cast:RuntimeWarning"),
]
triton = pytest.importorskip("triton")

from gemcore.kernels import mx  # noqa: E402
from gemcore.kernels.mx_gemm import mx_matmul_triton  # noqa: E402
from gemcore.kernels.mx_reference import dequantize_mx_reference, quantize_mx_reference  # noqa: E402
from gemcore.kernels.mx_triton import (COLS_TILE, ROWS_TILE, dequantize_mx_triton,  # noqa: E402
                                       quantize_mx_both_triton, quantize_mx_triton)

DEVICE = "cuda" if CUDA else "cpu"
ROUNDINGS = [True] if INTERPRET else [True, False]  # soft_round
ROW_TILE = dict(BLOCK_R=4, NB=2, num_warps=1) if INTERPRET else ROWS_TILE  # the strided-rows kernel
FLAT_TEST_TILE = dict(NBLK=4, num_warps=1) if INTERPRET else None  # contiguous whole blocks
COL_TILE = dict(NB=2, BLOCK_C=8, num_warps=1) if INTERPRET else None
BOTH_TILE = dict(NBR=1, NBC=2, num_warps=1) if INTERPRET else None
MM_TILE = dict(BLOCK_M=16, BLOCK_N=16, KB=2, num_warps=1, num_stages=1) if INTERPRET else None


def make_input(shape, seed, dtype=torch.float32, specials=True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-10, 10) if dtype == torch.float16 else (-40, 40)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g).float())
    flat = x.view(-1)
    flat[::11] *= 2.0**-14  # subnormal elements
    if specials and flat.numel() > 300:
        flat[:64] = 0.0  # whole zero blocks (in row layouts)
        flat[100] = math.nan
        flat[200] = math.inf
        flat[300] = -math.inf
        flat[301] = 448.0 * 2.0**3
    return x.to(dtype).to(DEVICE)


def assert_same_cast(x, elem, scale_rule, axis, soft_round, tile):
    want_d, want_s = quantize_mx_reference(x, elem, 32, axis, scale_rule)
    got_d, got_s = quantize_mx_triton(x, elem, 32, axis, scale_rule, soft_round=soft_round, tile=tile)
    assert got_d.dtype == want_d.dtype and got_d.shape == want_d.shape and got_s.shape == want_s.shape
    assert torch.equal(got_s, want_s), (got_s != want_s).nonzero()[:5]
    bad = (got_d.view(torch.uint8) != want_d.view(torch.uint8)).nonzero()
    assert bad.numel() == 0, (bad[:5], x[tuple(bad[0])].item())


# (64, 64) and (1024, 2048) fill whole tiles: the unmasked (EVEN) kernel variants
SHAPES = ([(6, 70), (33, 1), (1, 1), (9, 96), (64, 64)] if INTERPRET
          else [(1000, 4096), (777, 333), (1, 1), (4096, 96), (1024, 2048)])


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_rule", ["floor", "rceil"])
def test_cast_rows_and_cols_bit_exact(elem, scale_rule):
    for soft_round in ROUNDINGS:
        for seed, shape in enumerate(SHAPES):
            x = make_input(shape, seed)
            assert_same_cast(x, elem, scale_rule, 1, soft_round, ROW_TILE)
            assert_same_cast(x, elem, scale_rule, 0, soft_round, COL_TILE)
        for dtype in (torch.bfloat16, torch.float16):  # half-precision loads
            x = make_input(SHAPES[0], 7, dtype)
            assert_same_cast(x, elem, scale_rule, 1, soft_round, ROW_TILE)
            assert_same_cast(x, elem, scale_rule, 0, soft_round, COL_TILE)
        for seed, shape in enumerate(SHAPES):  # contiguous rows of whole blocks: the flat kernel
            if shape[1] % 32 == 0:
                assert_same_cast(make_input(shape, seed), elem, scale_rule, 1, soft_round, FLAT_TEST_TILE)
        for seed, shape in enumerate(SHAPES[-2:]):  # a persistent grid: programs loop over tiles
            x = make_input(shape, seed)
            assert_same_cast(x, elem, scale_rule, 1, soft_round, dict(ROW_TILE or ROWS_TILE, programs=3, STAGES=2))
            assert_same_cast(x, elem, scale_rule, 0, soft_round, dict(COL_TILE or COLS_TILE, programs=3, STAGES=2))
        x3 = make_input((3, 40, 5) if INTERPRET else (4, 300, 200), 9)
        assert_same_cast(x3, elem, scale_rule, 1, soft_round, COL_TILE)  # batched columns
        assert_same_cast(x3.transpose(1, 2), elem, scale_rule, 2, soft_round, ROW_TILE)  # strided rows


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_rule", ["floor", "rceil"])
def test_cast_both_orientations_one_pass(elem, scale_rule):
    for soft_round in ROUNDINGS:
        for seed, shape in enumerate([(40, 70), (1, 1), (65, 32)] if INTERPRET else [(1000, 2048), (333, 777)]):
            x = make_input(shape, seed, torch.bfloat16)
            (rd, rs), (cd, cs) = quantize_mx_both_triton(x, elem, scale_rule, soft_round, BOTH_TILE)
            for (d, s), axis in (((rd, rs), 1), ((cd, cs), 0)):
                want_d, want_s = quantize_mx_reference(x, elem, 32, axis, scale_rule)
                assert torch.equal(s, want_s) and torch.equal(d.view(torch.uint8), want_d.view(torch.uint8))


def test_public_entry_picks_triton():
    x = make_input((8, 64), 1)
    t = mx.quantize_mx(x, backend="triton")
    d, s = quantize_mx_reference(x, "e4m3", 32, -1, "floor")
    assert torch.equal(t.scale, s) and torch.equal(t.data.view(torch.uint8), d.view(torch.uint8))
    empty = mx.quantize_mx(torch.zeros(0, 64, device=DEVICE), backend="triton")
    assert empty.data.shape == (0, 64) and empty.scale.shape == (0, 2)


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_kernel(axis, dtype):
    x = make_input((40, 70) if INTERPRET else (1000, 3000), 4)
    d, s = quantize_mx_reference(x, "e4m3", 32, axis, "rceil")
    kw = dict(block_r=8, block_c=32, num_warps=1) if INTERPRET else {}
    got = dequantize_mx_triton(d, s, axis, dtype, **kw)
    want = dequantize_mx_reference(d, s, 32, axis, dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


MM_SHAPES = [(20, 70, 24), (33, 64, 17), (1, 32, 1), (5, 0, 3)] if INTERPRET else \
    [(1024, 2048, 768), (333, 1000, 517), (1, 32, 1), (16, 0, 8)]


#: the rule: the exact path (bf16 MMA on dequantized tiles) within 1e-4 of float64 of the
#: dequantized operands; the block-scaled MMA path (tl.dot_scaled) within 1e-3
BOUND = {"scaled": 1e-3}


def spread_blocks(shape, axis: int, g: torch.Generator) -> torch.Tensor:
    """randn with each 32-block along ``axis`` scaled by 2^U[-40, 40]."""
    x = torch.randn(shape, generator=g)
    n = x.shape[axis]
    e = torch.randint(-40, 41, (x.shape[1 - axis], -(-n // 32)), generator=g).float()
    f = torch.exp2(e).repeat_interleave(32, 1)[:, :n]
    return x * (f if axis == 1 else f.t())


@pytest.mark.parametrize("data", ["randn", "spread"])
@pytest.mark.parametrize("a_elem,b_elem", [("e4m3", "e4m3"), ("e4m3", "e5m2")])
def test_gemm_kernel_against_float64(a_elem, b_elem, data):
    """The Triton MX GEMM (tl.dot_scaled, a fast path) within 1e-3 of float64."""
    kernel, tile = "scaled", MM_TILE
    g = torch.Generator().manual_seed(0)
    for M, K, N in MM_SHAPES:
        if data == "spread":
            ax, bx = spread_blocks((M, K), 1, g), spread_blocks((K, N), 0, g)
        else:
            ax, bx = torch.randn(M, K, generator=g) * 4, torch.randn(K, N, generator=g)
        a = mx.quantize_mx(ax.to(DEVICE), elem=a_elem, axis=-1)
        b = mx.quantize_mx(bx.to(DEVICE), elem=b_elem, axis=0, scale_rule="rceil")
        want = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
        got = mx_matmul_triton(a.data, a.scale, b.data, b.scale, torch.float32, tile=tile)
        assert got.shape == (M, N)
        if K:
            assert rel_err(got, want) <= BOUND[kernel], (M, K, N, rel_err(got, want))
        else:
            assert (got == 0).all()
        # operands as transposed views (what MXLinear passes): W (N, K) blocked along K, as (K, N)
        w = mx.quantize_mx(torch.randn(N, K, generator=g).to(DEVICE), elem=b_elem, axis=-1).t()
        got = mx_matmul_triton(a.data, a.scale, w.data, w.scale, torch.bfloat16, tile=tile)
        want = a.dequantize(torch.float64) @ w.dequantize(torch.float64)
        if K:
            assert rel_err(got, want) <= 1e-2  # bf16 output


def test_nan_block_propagates_through_gemm():
    x = torch.randn(16, 64)
    x[3, 40] = math.nan
    a = mx.quantize_mx(x.to(DEVICE), axis=-1)
    b = mx.quantize_mx(torch.randn(64, 16).to(DEVICE), axis=0)
    out = mx_matmul_triton(a.data, a.scale, b.data, b.scale, torch.float32, tile=MM_TILE)
    assert out[3].isnan().all() and not out[:3].isnan().any()


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (the dequant_mm path calls cuBLAS)")
@pytest.mark.parametrize("backend", ["exact", "triton_scaled", "dequant_mm", "auto"])
@pytest.mark.parametrize("data", ["randn", "spread"])
def test_public_matmul_backends(backend, data):
    g = torch.Generator().manual_seed(1)
    if data == "spread":
        ax, bx = spread_blocks((512, 1024), 1, g), spread_blocks((1024, 384), 0, g)
    else:
        ax, bx = torch.randn(512, 1024, generator=g), torch.randn(1024, 384, generator=g)
    a = mx.quantize_mx(ax.cuda(), axis=-1)
    b = mx.quantize_mx(bx.cuda(), axis=0)
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
    runs = mx._auto_matmul(a.data) if backend == "auto" else backend
    bound = 1e-4 if runs in mx.EXACT_MATMULS else 1e-3
    assert rel_err(mx.mx_matmul(a, b, out_dtype=torch.float32, backend=backend), want) <= bound


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_mxlinear_cuda_matches_reference_backends():
    torch.manual_seed(0)
    lin = mx.MXLinear(1024, 768, device="cuda")
    ref = mx.MXLinear.from_linear(lin, cast_backend="reference", matmul_backend="reference")
    x = torch.randn(2048, 1024, device="cuda", requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(2048, 768, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = lin(x)
        y2 = ref(x2)
    assert y.dtype == torch.bfloat16
    y.backward(dy)
    gw = lin.weight.grad.clone()
    lin.weight.grad = None
    y2.backward(dy)
    assert rel_err(y, y2) <= 1e-2 and rel_err(x.grad, x2.grad) <= 1e-2
    assert rel_err(gw, lin.weight.grad) <= 1e-4
