"""Triton kernels of block-scaled FP8: the cast (both layouts in one read) and the GEMM.

Each mirrors a function of :mod:`gemcore.kernels.fp8_block_reference`; the cast is tested bit for
bit against it (on CPU under ``TRITON_INTERPRET=1``), the GEMM against float64.

* ``_fp8_block_cast``: one (BLOCK_R, 128) tile of x per program, read once. ``SQUARE``: the tile
  is one 128x128 block (weights); else each row of the tile is a 1x128 block (``ROWS``) and each
  column a 128x1 block (``COLS``, written transposed: what the wgrad GEMM multiplies along tokens).
  Scales are integer arithmetic on the amax's float32 bits (as in :mod:`mx_triton`); elements are
  one flushing multiply and the hardware conversion on a GPU, or rounded in software under the
  interpreter (whose own FP8 casts do not round to nearest even, and which runs no inline PTX).
  Loads past (R, C) read zeros: the outputs are padded to whole blocks.
* ``_fp8_block_mm``: C = A @ B^T, A (M, K) in 1x128 blocks, B (N, K) in 1x128 or 128x128 blocks
  (``B_ROWS``), K a multiple of 128. Per 128-wide K block: one FP8 MMA started from zero, then the
  partial sum times both scales added to the float32 accumulator (DeepSeek-V3's promotion).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gemcore.kernels.mx_gemm import _store_tile, _tile_rows_cols
from gemcore.kernels.mx_triton import _encode, _inv_scale, _scale_bytes

BLOCK = 128


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------- jit helpers
@triton.jit
def _block_byte(amax_bits):
    """int32 bits of blocks' amax -> E + 127 (int32): the smallest E with amax <= 448 * 2^E,
    clamped to [-126, 127]; 255 for NaN/Inf."""
    byte = _scale_bytes(amax_bits, 8, True)
    return tl.where(byte == 255, 255, tl.maximum(byte, 1))


@triton.jit
def _scale_value(byte):
    """E + 127 -> float32 2^E (NaN for 255)."""
    return tl.where(byte == 255, float("nan"), (byte << 23).to(tl.float32, bitcast=True))


@triton.jit
def _mul_ftz(x, inv):
    """float32 x * inv with float32 subnormal inputs flushed to zero of the same sign (PTX
    ``mul.rn.ftz.f32``): the flush of the reference at no extra instruction."""
    return tl.inline_asm_elementwise("mul.rn.ftz.f32 $0, $1, $2;", "=r,r,r", [x, inv],
                                     dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _e4m3(x, byte, SOFT_ROUND: tl.constexpr):
    """x (bf16 or float32) of blocks with scale bytes ``byte`` (broadcastable) ->
    E4M3 bytes (uint8), nearest even; subnormal x and NaN/Inf blocks as the reference has them.
    On a GPU: one flushing multiply by 2^-E (|x| * 2^-E <= 448 by the scale's choice, so nothing
    clamps) and the hardware conversion; NaN blocks multiply by NaN."""
    x = x.to(tl.float32)
    if SOFT_ROUND:
        x = tl.where((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x800000, x * 0.0, x)
        return _encode(x, _inv_scale(byte), byte == 255, 3, -6, 7, 448.0, 512.0, True, tl.float8e4nv)
    inv = tl.where(byte == 255, float("nan"), _inv_scale(byte))
    return _mul_ftz(x, inv).to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _amax_bits(bits, axis: tl.constexpr, B16: tl.constexpr):
    """Largest magnitude's float32 bits (int32) along ``axis`` of ``bits`` (|x|'s bits: int16 of
    bf16 when ``B16``), 0 where it is a float32 subnormal (read as zero)."""
    amax = tl.max(bits, axis=axis)
    if B16:
        amax = amax.to(tl.int32) << 16
    return tl.where(amax < 0x800000, 0, amax)


# --------------------------------------------------------------------------- cast
@triton.jit
def _fp8_block_cast(x_ptr, rdata_ptr, rscale_ptr, cdata_ptr, cscale_ptr, R, C, R_PAD, C_PAD,
                    stride_xr, stride_xc, stride_rsr, stride_rsc, stride_csr, stride_csc,
                    ROWS: tl.constexpr, COLS: tl.constexpr, SQUARE: tl.constexpr,
                    BLOCK_R: tl.constexpr, SOFT_ROUND: tl.constexpr, B16: tl.constexpr):
    """x (R, C) -> padded (R_PAD, C_PAD) outputs. ROWS: rdata (R_PAD, C_PAD), rscale[r, cb].
    COLS: cdata (C_PAD, R_PAD) = the transposed elements, cscale[c, rb]. SQUARE: rdata and (with
    COLS) its transpose cdata share the block's scale rscale[rb, cb]. Scale strides are given, so
    the caller picks their layout. ``B16``: x is bf16, kept 16-bit in registers (its magnitudes'
    int16 bits give the amax), which halves the registers a 128x128 tile holds."""
    pid_r = tl.program_id(0)
    pid_c = tl.program_id(1)
    r = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    c = (pid_c * 128 + tl.arange(0, 128)).to(tl.int64)
    x = tl.load(x_ptr + r[:, None] * stride_xr + c[None, :] * stride_xc,
                mask=(r[:, None] < R) & (c[None, :] < C), other=0.0)
    if B16:
        bits = x.to(tl.int16, bitcast=True) & 0x7FFF
    else:
        x = x.to(tl.float32)
        bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    row_ok = r[:, None] < R_PAD
    if SQUARE:
        block_amax = tl.max(_amax_bits(bits, 1, B16), axis=0)
        byte = _block_byte(block_amax)
        q = _e4m3(x, byte, SOFT_ROUND)
        tl.store(rdata_ptr + r[:, None] * C_PAD + c[None, :], q)
        if COLS:
            # The transposed copy is encoded again, from a per-column byte vector (each column's
            # amax raised to the block's: the block's byte in every column), so that it is a tile
            # of its own, built as the COLS branch below builds it. Stored from the same 1-byte
            # tile as the row-major copy, the transposed store came out corrupted on an H100
            # (triton 3.6), while each copy alone is right; compare triton-lang/triton#11111.
            byte_c = _block_byte(tl.maximum(_amax_bits(bits, 0, B16), block_amax))  # (128,)
            q_t = _e4m3(x, byte_c[None, :], SOFT_ROUND)
            tl.store(cdata_ptr + c[None, :] * R_PAD + r[:, None], q_t)
        tl.store(rscale_ptr + pid_r * stride_rsr + pid_c * stride_rsc, _scale_value(byte))
    else:
        if ROWS:
            byte = _block_byte(_amax_bits(bits, 1, B16))  # (BLOCK_R,)
            q = _e4m3(x, byte[:, None], SOFT_ROUND)
            tl.store(rdata_ptr + r[:, None] * C_PAD + c[None, :], q, mask=row_ok)
            tl.store(rscale_ptr + r * stride_rsr + pid_c * stride_rsc, _scale_value(byte), mask=r < R_PAD)
        if COLS:  # BLOCK_R == 128: each column of the tile is one block
            byte = _block_byte(_amax_bits(bits, 0, B16))  # (128,)
            q = _e4m3(x, byte[None, :], SOFT_ROUND)
            tl.store(cdata_ptr + c[None, :] * R_PAD + r[:, None], q)
            tl.store(cscale_ptr + c * stride_csr + pid_r * stride_csc, _scale_value(byte))


#: rows-only casts take 32-row tiles (more programs); 128x1 blocks need 128 rows: rows + columns of
#: a bf16 128x128 tile with 8 warps run at 75-89 % of the copy limit on an H100, 4 warps at 65-77 %
#: (GPU time from CUDA-graph replays, 17,255 and 24,576 rows; docs/fp8.md); the weight cast keeps
#: 8 warps (its transposed-store workaround was verified with them)
ROWS_TILE = dict(BLOCK_R=32, num_warps=4)
FULL_TILE = dict(BLOCK_R=128, num_warps=8)
SQUARE_TILE = dict(BLOCK_R=128, num_warps=8)


def cast_triton(x: torch.Tensor, r_pad: int, c_pad: int, *, rows: bool, cols: bool, square: bool,
                rscale: torch.Tensor | None, cscale: torch.Tensor | None,
                soft_round: bool | None = None):
    """Launch the cast of 2-D ``x`` (R, C) into zero-padded (r_pad, c_pad) FP8 outputs.

    Returns (rdata (r_pad, c_pad) or None, cdata (c_pad, r_pad) or None); the scales are written
    into ``rscale`` / ``cscale`` (allocated by the caller in the layout it wants)."""
    if soft_round is None:
        soft_round = _interpreting()
    dev = x.device
    rdata = torch.empty((r_pad, c_pad), dtype=torch.float8_e4m3fn, device=dev) if (rows or square) else None
    cdata = torch.empty((c_pad, r_pad), dtype=torch.float8_e4m3fn, device=dev) if cols else None
    if r_pad == 0 or c_pad == 0:
        return rdata, cdata
    tile = SQUARE_TILE if square else ROWS_TILE if not cols else FULL_TILE
    grid = (triton.cdiv(r_pad, tile["BLOCK_R"]), c_pad // BLOCK)
    dummy = torch.empty(1, dtype=torch.float32, device=dev)
    rs = rscale if rscale is not None else dummy
    cs = cscale if cscale is not None else dummy
    rs_strides = rscale.stride() if rscale is not None else (0, 0)
    cs_strides = cscale.stride() if cscale is not None else (0, 0)
    rd = rdata.view(torch.uint8) if rdata is not None else dummy
    cd = cdata.view(torch.uint8) if cdata is not None else dummy
    _fp8_block_cast[grid](x, rd, rs, cd, cs, x.shape[0], x.shape[1], r_pad, c_pad, *x.stride(),
                          *rs_strides, *cs_strides, ROWS=rows, COLS=cols, SQUARE=square,
                          SOFT_ROUND=soft_round, B16=x.dtype == torch.bfloat16, **tile)
    return rdata, cdata


# --------------------------------------------------------------------------- GEMM
@triton.jit
def _fp8_block_mm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                  stride_am, stride_ak, stride_asm, stride_ask, stride_bn, stride_bk,
                  stride_bsn, stride_bsk, stride_cm, stride_cn,
                  B_ROWS: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """C (M, N) = sum over K blocks kb of (A_kb @ B_kb^T) * sa[m, kb] * sb[n // B_ROWS, kb]."""
    offs_m, offs_n = _tile_rows_cols(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    k = tl.arange(0, 128)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + k[None, :] * stride_ak  # (BLOCK_M, 128)
    b_ptrs = b_ptr + k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # (128, BLOCK_N)
    as_ptrs = as_ptr + offs_m * stride_asm
    bs_ptrs = bs_ptr + (offs_n // B_ROWS) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // 128):
        a = tl.load(a_ptrs, mask=mask_m[:, None], other=0).to(tl.float8e4nv, bitcast=True)
        b = tl.load(b_ptrs, mask=mask_n[None, :], other=0).to(tl.float8e4nv, bitcast=True)
        sa = tl.load(as_ptrs + kb * stride_ask, mask=mask_m, other=0.0)
        sb = tl.load(bs_ptrs + kb * stride_bsk, mask=mask_n, other=0.0)
        if DOT_F32:
            partial = tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            partial = tl.dot(a, b)
        acc += (partial * sa[:, None]) * sb[None, :]  # sa * sb alone could underflow
        a_ptrs += 128 * stride_ak
        b_ptrs += 128 * stride_bk
    _store_tile(c_ptr, acc, offs_m, offs_n, M, N, stride_cm, stride_cn)


#: default tile: not autotuned; faster on an H100 than the other tiles `gem bench mx` times (docs/fp8.md)
MM_TILE = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=4)


def fp8_block_mm_triton(a_data, a_scale, b_data, b_scale, b_rows: int, out_dtype=torch.bfloat16,
                        tile: dict | None = None) -> torch.Tensor:
    """a_data (M, K) with a_scale (M, K/128); b_data (N, K) with b_scale (N/b_rows, K/128);
    any strides. -> (M, N) in ``out_dtype``."""
    M, K = a_data.shape
    N = b_data.shape[0]
    c = torch.empty((M, N), dtype=out_dtype, device=a_data.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    t = dict(MM_TILE, **(tile or {}))
    grid = (triton.cdiv(M, t["BLOCK_M"]) * triton.cdiv(N, t["BLOCK_N"]),)
    a8, b8 = a_data.view(torch.uint8), b_data.view(torch.uint8)
    _fp8_block_mm[grid](a8, a_scale, b8, b_scale, c, M, N, K, *a8.stride(), *a_scale.stride(),
                        *b8.stride(), *b_scale.stride(), *c.stride(), B_ROWS=b_rows,
                        DOT_F32=_interpreting(), **t)
    return c
