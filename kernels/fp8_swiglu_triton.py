"""SwiGLU fused with its block-scaled FP8 casts: the MLP's activation writes FP8, not bf16.

In an FP8 SwiGLU MLP (``y = down(silu(g) * u)`` with ``g, u = gate_up(x).chunk(2, -1)``), the
activation's output ``h`` and, in the backward pass, the gradient of ``gate_up``'s output are each
written in bf16 and then read back by a cast into 1x128 blocks along rows and 128x1 blocks along
tokens (:mod:`gemcore.kernels.fp8_block_triton`). These kernels compute them tile by tile and
cast them straight away, so neither bf16 matrix is written or read back.

* ``_swiglu_cast`` (``BACKWARD=False``): gu (M, 2F) bf16 -> h = bf16(silu(g) * u), (M, F).
* ``_swiglu_cast`` (``BACKWARD=True``): dh (M, F) and gu -> d(gu) (M, 2F) =
  [bf16(dh * (u * silu'(g))), bf16(dh * silu(g))], silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).

Each value is computed in float32 from the bf16 inputs and rounded once to bf16 (what
``torch.compile`` computes for the unfused activation), then cast exactly as
:func:`gemcore.kernels.fp8_block_reference.quantize_rows_reference` casts that bf16 matrix (both
layouts, zero-padded to whole blocks): the helpers are those of the cast kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from gemcore.kernels.fp8_block_triton import (BLOCK, _amax_bits, _block_byte, _e4m3, _interpreting,
                                              _scale_value)

#: 128 rows: a 128x1 block along tokens per column
SWIGLU_TILE = dict(BLOCK_R=128)
#: warps per tile, by pass. The forward holds two float32 128x128 operands (g, u) and the backward
#: three (g, u, dh); on an H100 at 17,255 x 4,096 the forward took 236 µs with 4 warps and 274 with
#: 8, the backward 544 µs with 4 and 473 with 8 (docs/kernels.md)
SWIGLU_WARPS = {"forward": 4, "backward": 8}


@triton.jit
def _to_bf16(x, SOFT_ROUND: tl.constexpr):
    """float32 -> bf16, nearest even. Under the interpreter (whose own conversion truncates) the
    rounding is done on the float32 bits first, so that the conversion is exact."""
    if SOFT_ROUND:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536: 0xFFFF0000 as int32
        x = bits.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)


@triton.jit
def _swiglu_cast(gu_ptr, dh_ptr, rdata_ptr, rscale_ptr, cdata_ptr, cscale_ptr, M, F, R_PAD, C_PAD,
                 stride_gm, stride_gc, stride_dm, stride_dc, stride_rsr, stride_rsc, stride_csr,
                 stride_csc, BACKWARD: tl.constexpr, BLOCK_R: tl.constexpr, SOFT_ROUND: tl.constexpr):
    """One (BLOCK_R = 128, 128) tile of the output (h, or d(gu)) per program, cast into 1x128
    blocks along its rows (rdata (R_PAD, C_PAD), rscale[r, cb]) and 128x1 blocks along its
    columns, written transposed (cdata (C_PAD, R_PAD), cscale[c, rb]).

    One-dimensional grid, column tiles varying fastest, so that programs launched together share
    rows (C_PAD // 128 column tiles per row tile). Backward, column tile p is the gate tile (p
    even) or the up tile (p odd) of the same 128 features: the two read the same g and dh tiles,
    so the second reads them from L2, and the up tile does not read u."""
    n_col_tiles = C_PAD // 128
    pid_c = tl.program_id(0) % n_col_tiles
    pid_r = tl.program_id(0) // n_col_tiles
    # 64-bit scalar bases, 32-bit offsets inside the tile (the wrapper bounds them): a tile of
    # 64-bit offsets takes two registers an element. The backward folds u into its factor before
    # it loads dh, so two float32 tiles are live, not three (registers and spills of the sm_90
    # build: docs/kernels.md, tools/kernel_resources.py)
    row0 = pid_r.to(tl.int64) * BLOCK_R
    rr = tl.arange(0, BLOCK_R)
    cc = tl.arange(0, 128)
    mask = (row0 + rr)[:, None] < M  # the grid covers the columns exactly (F is a multiple of 128)
    g_base = gu_ptr + row0 * stride_gm
    g_off = rr[:, None] * stride_gm + cc[None, :] * stride_gc
    if BACKWARD:  # output column tile of d(gu): the gate half (c < F) or the up half
        up_half = pid_c % 2 == 1
        f0 = (pid_c // 2) * 128
        c0 = tl.where(up_half, f0 + F, f0)
        g = tl.load(g_base + f0 * stride_gc + g_off, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        if up_half:  # d(u) = dh * silu(g): u is not read
            factor = g * s
        else:
            factor = tl.load(g_base + (f0 + F) * stride_gc + g_off, mask=mask, other=0.0).to(tl.float32) * (
                s * (1.0 + g * (1.0 - s)))
        dh = tl.load(dh_ptr + row0 * stride_dm + f0 * stride_dc + (rr[:, None] * stride_dm + cc[None, :] * stride_dc),
                     mask=mask, other=0.0).to(tl.float32)
        value = dh * factor
        c_tile = tl.where(up_half, F // 128 + pid_c // 2, pid_c // 2)
    else:
        c0 = pid_c * 128
        g = tl.load(g_base + c0 * stride_gc + g_off, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(g_base + (c0 + F) * stride_gc + g_off, mask=mask, other=0.0).to(tl.float32)
        value = g * (1.0 / (1.0 + tl.exp(-g))) * u
        c_tile = pid_c
    x = _to_bf16(value, SOFT_ROUND)
    bits = x.to(tl.int16, bitcast=True) & 0x7FFF
    row_byte = _block_byte(_amax_bits(bits, 1, True))  # (BLOCK_R,)
    tl.store(rdata_ptr + (row0 * C_PAD + c0) + (rr[:, None] * C_PAD + cc[None, :]),
             _e4m3(x, row_byte[:, None], SOFT_ROUND), mask=(row0 + rr)[:, None] < R_PAD)
    tl.store(rscale_ptr + (row0 * stride_rsr + c_tile.to(tl.int64) * stride_rsc) + rr * stride_rsr,
             _scale_value(row_byte), mask=(row0 + rr) < R_PAD)
    col_byte = _block_byte(_amax_bits(bits, 0, True))  # (128,)
    tl.store(cdata_ptr + (c0.to(tl.int64) * R_PAD + row0) + (cc[None, :] * R_PAD + rr[:, None]),
             _e4m3(x, col_byte[None, :], SOFT_ROUND))
    tl.store(cscale_ptr + (c0.to(tl.int64) * stride_csr + pid_r.to(tl.int64) * stride_csc) + cc * stride_csr,
             _scale_value(col_byte))


def swiglu_cast_triton(gu: torch.Tensor, dh: torch.Tensor | None = None, *,
                       soft_round: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """h = silu(g) * u of ``gu`` (M, 2F) bf16, or with ``dh`` (M, F) bf16 the gradient of ``gu``,
    cast to block-scaled FP8 in both layouts. F must be a multiple of 128.

    Returns (rows (Mp, N) E4M3, row scales (Mp, N/128) float32 column-major, cols (N, Mp) E4M3,
    col scales (N, Mp/128) float32 column-major); N = F (h) or 2F (the gradient), Mp = M rounded
    up to a multiple of 128, padding zero: the layouts :func:`gemcore.kernels.fp8_block.quantize_act`
    returns."""
    if gu.dim() != 2 or gu.shape[1] % (2 * BLOCK):
        raise ValueError(f"gu must be (M, 2F) with F a multiple of {BLOCK}, got shape {tuple(gu.shape)}")
    if gu.dtype != torch.bfloat16:
        raise ValueError(f"gu must be bfloat16, got {gu.dtype}")
    M, F = gu.shape[0], gu.shape[1] // 2
    if dh is not None:
        if dh.shape != (M, F) or dh.dtype != torch.bfloat16:
            raise ValueError(f"dh must be ({M}, {F}) bfloat16 like gu's halves, got {tuple(dh.shape)} {dh.dtype}")
    if soft_round is None:
        soft_round = _interpreting()
    n = F if dh is None else 2 * F
    m_pad = -(-M // BLOCK) * BLOCK
    # the kernel's offsets inside a 128 x 128 tile are 32-bit: 128 times a row stride (or the
    # padded rows, for the transposed store) must stay below 2^31
    longest = max([m_pad, *gu.stride()] + ([] if dh is None else list(dh.stride())))
    if BLOCK * longest >= 2**31:
        raise ValueError(f"gu: at most {2**31 // BLOCK - 1:,} rows, and row strides below that, per call; "
                         f"got shape {tuple(gu.shape)} with strides {gu.stride()}")
    dev = gu.device
    rows = torch.empty((m_pad, n), dtype=torch.float8_e4m3fn, device=dev)
    cols = torch.empty((n, m_pad), dtype=torch.float8_e4m3fn, device=dev)
    rscale = torch.empty((n // BLOCK, m_pad), dtype=torch.float32, device=dev).t()
    cscale = torch.empty((m_pad // BLOCK, n), dtype=torch.float32, device=dev).t()
    if m_pad:
        d = dh if dh is not None else gu
        grid = (n // BLOCK * (m_pad // SWIGLU_TILE["BLOCK_R"]),)
        _swiglu_cast[grid](gu, d, rows.view(torch.uint8), rscale, cols.view(torch.uint8), cscale, M, F,
                           m_pad, n, *gu.stride(), *d.stride(), *rscale.stride(), *cscale.stride(),
                           BACKWARD=dh is not None, SOFT_ROUND=soft_round,
                           num_warps=SWIGLU_WARPS["forward" if dh is None else "backward"], **SWIGLU_TILE)
    return rows, rscale, cols, cscale
