"""The fused SwiGLU + FP8 cast kernels against the reference: the activation (or its gradient)
computed in float32 and rounded to bf16, then cast by the reference, in both layouts.

On CPU this module only runs under TRITON_INTERPRET=1 (test_fp8_swiglu.py starts it in a
subprocess with that set), at small sizes; on a CUDA GPU at real sizes. The kernels compute
sigmoid with Triton's exp, which may differ from torch's in the last float32 bit, so a few
elements may round to a neighbouring bf16 and FP8 value: at most 1 in 1,000 elements and 1 in 100
scales may differ, and every element stays within FP8's rounding of the float64 value. Marked gpu.
"""
from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or INTERPRET), reason="needs a CUDA GPU or TRITON_INTERPRET=1 (run by test_fp8_swiglu.py)"),
]
triton = pytest.importorskip("triton")

from gemcore.kernels import fp8_block as fb  # noqa: E402
from gemcore.kernels.fp8_swiglu import swiglu_backward_reference, swiglu_reference  # noqa: E402
from gemcore.kernels.fp8_swiglu_triton import swiglu_cast_triton  # noqa: E402

DEVICE = "cuda" if CUDA else "cpu"
SHAPES = [(130, 256), (1, 128), (0, 128)] if INTERPRET else [(4096 + 17, 1024), (1, 256), (0, 128)]


def _inputs(M: int, F: int, kind: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    gu = torch.randn(M, 2 * F, generator=gen) * 2
    dh = torch.randn(M, F, generator=gen)
    if kind == "spread":  # block magnitudes across 2^-20 .. 2^20
        gu = gu * torch.exp2(torch.randint(-20, 21, (M, 1), generator=gen).float())
        dh = dh * torch.exp2(torch.randint(-20, 21, (1, F), generator=gen).float())
    return gu.to(torch.bfloat16).to(DEVICE), dh.to(torch.bfloat16).to(DEVICE)


def _col_major(scale: torch.Tensor) -> bool:
    """Whether (R, n) scales are laid out column-major (what cuBLAS reads)."""
    return scale.shape[1] <= 1 or scale.shape[0] <= 1 or scale.stride(0) == 1


def _compare(got: tuple, want: fb.BlockFP8, exact64: torch.Tensor, what: str) -> None:
    data, scale = got
    assert data.shape == want.data.shape and data.dtype == torch.float8_e4m3fn, what
    assert scale.shape == want.scale.shape and _col_major(scale) and _col_major(want.scale), what
    if data.numel() == 0:
        return
    same_bits = (data.view(torch.uint8) == want.data.view(torch.uint8)).float().mean().item()
    same_scales = (scale == want.scale).float().mean().item()
    assert same_bits >= 0.999, f"{what}: {1 - same_bits:.2e} of the elements differ from the reference"
    assert same_scales >= 0.99, f"{what}: {1 - same_scales:.2e} of the scales differ from the reference"
    deq = fb.BlockFP8(data, scale, 1).dequantize(torch.float64)[: exact64.shape[0], : exact64.shape[1]]
    blocks = scale.double().repeat_interleave(128, 1)[: exact64.shape[0], : exact64.shape[1]] \
        if scale.shape[0] == data.shape[0] else None
    # E4M3 keeps 3 mantissa bits (relative rounding <= 2^-4), bf16 8 (2^-9); subnormals: 2^-10 of the scale
    bound = exact64.abs() * (2.0**-4 + 2.0**-8) + (blocks * 2.0**-9 if blocks is not None else 0.0)
    assert bool(((deq - exact64).abs() <= bound + 1e-30).all()), f"{what}: an element beyond FP8 rounding"


@pytest.mark.parametrize("M,F", SHAPES)
@pytest.mark.parametrize("kind", ["randn", "spread"])
@pytest.mark.parametrize("backward", [False, True])
def test_fused_cast_matches_the_reference(M, F, kind, backward):
    gu, dh = _inputs(M, F, kind)
    rows, rscale, cols, cscale = swiglu_cast_triton(gu, dh if backward else None)
    value = swiglu_backward_reference(dh, gu) if backward else swiglu_reference(gu)
    want_rows, want_cols = fb.quantize_act(value.cpu(), backend="reference")
    g, u = gu.double().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    exact = torch.cat([dh.double() * u * s * (1 + g * (1 - s)), dh.double() * g * s], -1) if backward else g * s * u
    _compare((rows.cpu(), rscale.cpu()), want_rows, exact.cpu(), f"rows {M}x{F} {kind} backward={backward}")
    # the columns: the transposed matrix in 1x128 blocks along tokens
    data, scale = cols.cpu(), cscale.cpu()
    assert data.shape == want_cols.data.shape and scale.shape == want_cols.scale.shape and _col_major(scale)
    if data.numel():
        same = (data.view(torch.uint8) == want_cols.data.view(torch.uint8)).float().mean().item()
        assert same >= 0.999, f"columns: {1 - same:.2e} of the elements differ"
        deq_rows = fb.BlockFP8(rows.cpu(), rscale.cpu(), 1).dequantize(torch.float64)
        deq_cols = fb.BlockFP8(data, scale, 1).dequantize(torch.float64).t()
        assert torch.allclose(deq_cols, deq_rows, rtol=2.0**-3, atol=float(scale.max()) * 2.0**-9)


def test_bad_input_is_named():
    gu = torch.zeros(4, 200, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="gu must be \\(M, 2F\\) with F a multiple of 128"):
        swiglu_cast_triton(gu)
    with pytest.raises(ValueError, match="gu must be bfloat16"):
        swiglu_cast_triton(torch.zeros(4, 256, device=DEVICE))
    with pytest.raises(ValueError, match="dh must be \\(4, 128\\) bfloat16"):
        swiglu_cast_triton(torch.zeros(4, 256, dtype=torch.bfloat16, device=DEVICE),
                           torch.zeros(4, 256, dtype=torch.bfloat16, device=DEVICE))


def test_a_row_stride_past_the_32_bit_tile_offsets_is_refused():
    """The kernel's offsets inside a tile are 32-bit: 128 rows of a stride of 2^24 elements would
    wrap, so the wrapper refuses it by name instead of writing elsewhere."""
    storage = torch.zeros(2**24 + 256, dtype=torch.bfloat16, device=DEVICE)
    gu = storage.as_strided((2, 256), (2**24, 1))
    with pytest.raises(ValueError, match="gu: at most 16,777,215 rows, and row strides below that"):
        swiglu_cast_triton(gu)
