"""Triton MX kernels: the cast (along rows or along columns, or both in one pass) and dequantize.

Each kernel mirrors a function of :mod:`gemcore.kernels.mx_reference` and is tested bit for bit
against it (on CPU under ``TRITON_INTERPRET=1``). The GEMMs are in :mod:`gemcore.kernels.mx_gemm`.

The cast works on the float32 bits: blocks' largest magnitudes are an integer max of
``bits & 0x7FFFFFFF`` (non-negative floats order like their bits; NaN and Inf are the largest), so
the scale byte is integer arithmetic on the exponent field:

* floor: byte = clamp(exponent_field(amax) - emax, 0, 254)
* rceil: the same plus one when amax's mantissa exceeds 1.75 (max_normal = 1.75 * 2^emax)
* byte 255 when the block holds NaN or Inf.

Elements are rounded in software (``SOFT_ROUND``: adding and subtracting 1.5 * 2^(23 + log2 q)
rounds to a multiple of the quantum q, half to even, then the byte is assembled from the bits) or
by the hardware conversion (``cvt.rn.satfinite`` on sm_89+). The interpreter's own FP8 casts do
not round to nearest even, so tests run the software path there; the GPU test checks both.
"""
from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from gemcore.kernels.mx_reference import BLOCK, FORMATS

_TL_ELEM = {"e4m3": tl.float8e4nv, "e5m2": tl.float8e5}


# --------------------------------------------------------------------------- jit helpers
@triton.jit
def _scale_bytes(amax_bits, EMAX: tl.constexpr, RCEIL: tl.constexpr):
    """int32 bits of each block's amax -> biased E8M0 byte (int32)."""
    byte = (amax_bits >> 23) - EMAX
    if RCEIL:
        byte += ((amax_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 0), 254)
    return tl.where(amax_bits >= 0x7F800000, 255, byte)


@triton.jit
def _inv_scale(byte):
    """Biased E8M0 byte (int32, one per block) -> float32 2^-E. Byte 254 (E = 127) would need a
    subnormal 2^-127 and is unreachable from float32 input (it needs amax >= 2^135), so it is
    clamped to 2^-126 here."""
    return (tl.minimum(tl.maximum(254 - byte, 1), 254) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _encode(x, inv, is_nan, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
            MAX_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, SOFT_ROUND: tl.constexpr,
            ELEM: tl.constexpr):
    """float32 ``x`` -> element bytes (uint8). ``inv`` (2^-E) and ``is_nan`` (byte 255) are per
    block, broadcastable to ``x``: computing them on the block shape keeps the per-element work
    to a multiply, a clamp and the conversion on the hardware path."""
    y = x * inv
    if SOFT_ROUND:
        a = tl.minimum(tl.abs(y), MAX_NORMAL)
        exp_a = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, EMIN)
        magic = (((exp_a - MBITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
        r = (a + magic) - magic  # nearest multiple of 2^(exp_a - MBITS), half to even
        r_bits = r.to(tl.int32, bitcast=True)
        exp_r = (r_bits >> 23) - 127
        normal = ((exp_r + BIAS) << MBITS) | ((r_bits >> (23 - MBITS)) & ((1 << MBITS) - 1))
        subnormal = (r * SUB_SCALE).to(tl.int32)
        q = tl.where(exp_r >= EMIN, normal, subnormal)
        q = q | ((x.to(tl.int32, bitcast=True) >> 24) & 0x80)
        q = tl.where(is_nan, 0x7F, q)
        return q.to(tl.uint8)
    else:
        # min/max return the non-NaN operand, so NaN blocks are set after the clamp
        y = tl.minimum(tl.maximum(y, -MAX_NORMAL), MAX_NORMAL)
        y = tl.where(is_nan, float("nan"), y)
        return y.to(ELEM).to(tl.uint8, bitcast=True)


@triton.jit
def _scale_factor(byte):
    """Biased E8M0 byte -> float32 2^(byte - 127): byte 0 is the subnormal 2^-127, 255 is NaN."""
    b = byte.to(tl.int32)
    bits = tl.where(b == 0, 0x400000, b << 23)
    bits = tl.where(b == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


# --------------------------------------------------------------------------- cast kernels
@triton.jit
def _mx_cast_rows(x_ptr, data_ptr, scale_ptr, R, C, stride_xr, stride_xc, stride_dr, stride_dc,
                  stride_sr, stride_sc, BLOCK_R: tl.constexpr, NB: tl.constexpr,
                  EMAX: tl.constexpr, RCEIL: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                  BIAS: tl.constexpr, MAX_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, SOFT_ROUND: tl.constexpr,
                  ELEM: tl.constexpr, EVEN: tl.constexpr, STAGES: tl.constexpr):
    """Blocks along C. Tile: (BLOCK_R rows, NB blocks, 32). ``EVEN``: the tiles cover (R, C)
    exactly, so no access is masked. A grid smaller than the tile count loops over the tiles
    (persistent), ``STAGES`` deep (loads of later tiles issued while one is encoded)."""
    n_col_tiles = tl.cdiv(C, NB * 32)
    n_tiles = tl.cdiv(R, BLOCK_R) * n_col_tiles
    for pid in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        pid_r = pid // n_col_tiles
        pid_c = pid % n_col_tiles
        r1 = (pid_r * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
        b1 = pid_c * NB + tl.arange(0, NB)
        rows = r1[:, None, None]
        cols = b1[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
        mask = None if EVEN else (rows < R) & (cols < C)
        if EVEN:  # (a load given `other` must be given a mask)
            x = tl.load(x_ptr + rows * stride_xr + cols * stride_xc).to(tl.float32)
        else:
            x = tl.load(x_ptr + rows * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=2)  # (BLOCK_R, NB)
        byte = _scale_bytes(amax, EMAX, RCEIL)
        inv, is_nan = _inv_scale(byte), byte == 255
        q = _encode(x, inv[:, :, None], is_nan[:, :, None], MBITS, EMIN, BIAS, MAX_NORMAL, SUB_SCALE,
                    SOFT_ROUND, ELEM)
        tl.store(data_ptr + rows * stride_dr + cols * stride_dc, q, mask=mask)
        s_rows = r1[:, None]
        s_cols = b1[None, :]
        tl.store(scale_ptr + s_rows * stride_sr + s_cols * stride_sc, byte.to(tl.uint8),
                 mask=None if EVEN else (s_rows < R) & (s_cols * 32 < C))


@triton.jit
def _mx_cast_flat(x_ptr, data_ptr, scale_ptr, n_blocks, NBLK: tl.constexpr, EMAX: tl.constexpr,
                  RCEIL: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                  MAX_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, SOFT_ROUND: tl.constexpr,
                  ELEM: tl.constexpr, EVEN: tl.constexpr):
    """Blocks along the last axis of a contiguous tensor whose last axis is a multiple of 32: a
    flat run of ``n_blocks`` 32-element blocks, scales one byte each in the same order. Tile:
    (NBLK blocks, 32), every access contiguous. ``EVEN``: NBLK divides n_blocks (no mask)."""
    blk = tl.program_id(0).to(tl.int64) * NBLK + tl.arange(0, NBLK)
    offs = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    if EVEN:
        x = tl.load(x_ptr + offs).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=blk[:, None] < n_blocks, other=0.0).to(tl.float32)
    amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # (NBLK,)
    byte = _scale_bytes(amax, EMAX, RCEIL)
    q = _encode(x, _inv_scale(byte)[:, None], (byte == 255)[:, None], MBITS, EMIN, BIAS, MAX_NORMAL,
                SUB_SCALE, SOFT_ROUND, ELEM)
    if EVEN:
        tl.store(data_ptr + offs, q)
        tl.store(scale_ptr + blk, byte.to(tl.uint8))
    else:
        tl.store(data_ptr + offs, q, mask=blk[:, None] < n_blocks)
        tl.store(scale_ptr + blk, byte.to(tl.uint8), mask=blk < n_blocks)


@triton.jit
def _mx_cast_cols(x_ptr, data_ptr, scale_ptr, R, C, stride_xb, stride_xr, stride_xc, stride_db,
                  stride_dr, stride_dc, stride_sb, stride_sr, stride_sc, NB: tl.constexpr,
                  BLOCK_C: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr,
                  MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                  MAX_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, SOFT_ROUND: tl.constexpr, ELEM: tl.constexpr,
                  EVEN: tl.constexpr, STAGES: tl.constexpr):
    """Blocks along R (one batch of a (B, R, C) view per grid row). Tile: (NB blocks, 32, BLOCK_C).
    ``EVEN`` and the persistent loop as in :func:`_mx_cast_rows`."""
    batch = tl.program_id(1).to(tl.int64)
    x_ptr += batch * stride_xb
    data_ptr += batch * stride_db
    scale_ptr += batch * stride_sb
    n_col_tiles = tl.cdiv(C, BLOCK_C)
    n_tiles = tl.cdiv(R, NB * 32) * n_col_tiles
    for pid in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        pid_r = pid // n_col_tiles
        pid_c = pid % n_col_tiles
        b1 = (pid_r * NB + tl.arange(0, NB)).to(tl.int64)
        c1 = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        rows = b1[:, None, None] * 32 + tl.arange(0, 32)[None, :, None]
        cols = c1[None, None, :]
        mask = None if EVEN else (rows < R) & (cols < C)
        if EVEN:
            x = tl.load(x_ptr + rows * stride_xr + cols * stride_xc).to(tl.float32)
        else:
            x = tl.load(x_ptr + rows * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)  # (NB, BLOCK_C)
        byte = _scale_bytes(amax, EMAX, RCEIL)
        inv, is_nan = _inv_scale(byte), byte == 255
        q = _encode(x, inv[:, None, :], is_nan[:, None, :], MBITS, EMIN, BIAS, MAX_NORMAL, SUB_SCALE,
                    SOFT_ROUND, ELEM)
        tl.store(data_ptr + rows * stride_dr + cols * stride_dc, q, mask=mask)
        s_rows = b1[:, None]
        s_cols = c1[None, :]
        tl.store(scale_ptr + s_rows * stride_sr + s_cols * stride_sc, byte.to(tl.uint8),
                 mask=None if EVEN else (s_rows * 32 < R) & (s_cols < C))


@triton.jit
def _mx_cast_both(x_ptr, rdata_ptr, rscale_ptr, cdata_ptr, cscale_ptr, R, C, stride_xr, stride_xc,
                  NBR: tl.constexpr, NBC: tl.constexpr, EMAX: tl.constexpr, RCEIL: tl.constexpr,
                  MBITS: tl.constexpr, EMIN: tl.constexpr, BIAS: tl.constexpr,
                  MAX_NORMAL: tl.constexpr, SUB_SCALE: tl.constexpr, SOFT_ROUND: tl.constexpr, ELEM: tl.constexpr):
    """One read, both orientations: outputs are contiguous (R, C) data with (R, ceil(C/32))
    scales (blocks along C) and (ceil(R/32), C) scales (blocks along R).
    Tile: (NBR, 32, NBC, 32) = (row blocks, row in block, column blocks, column in block)."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(C, NBC * 32)
    pid_r = pid // n_col_tiles
    pid_c = pid % n_col_tiles
    rb1 = (pid_r * NBR + tl.arange(0, NBR)).to(tl.int64)
    cb1 = pid_c * NBC + tl.arange(0, NBC)
    j = tl.arange(0, 32)
    rows = rb1[:, None, None, None] * 32 + j[None, :, None, None]
    cols = cb1[None, None, :, None] * 32 + j[None, None, None, :]
    mask = (rows < R) & (cols < C)
    x = tl.load(x_ptr + rows * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    nsb = tl.cdiv(C, 32)
    # blocks along C
    byte = _scale_bytes(tl.max(bits, axis=3), EMAX, RCEIL)  # (NBR, 32, NBC)
    q = _encode(x, _inv_scale(byte)[:, :, :, None], (byte == 255)[:, :, :, None], MBITS, EMIN, BIAS,
                MAX_NORMAL, SUB_SCALE, SOFT_ROUND, ELEM)
    tl.store(rdata_ptr + rows * C + cols, q, mask=mask)
    s_rows = rb1[:, None, None] * 32 + j[None, :, None]
    s_cols = cb1[None, None, :]
    tl.store(rscale_ptr + s_rows * nsb + s_cols, byte.to(tl.uint8), mask=(s_rows < R) & (s_cols * 32 < C))
    # blocks along R
    byte = _scale_bytes(tl.max(bits, axis=1), EMAX, RCEIL)  # (NBR, NBC, 32)
    q = _encode(x, _inv_scale(byte)[:, None, :, :], (byte == 255)[:, None, :, :], MBITS, EMIN, BIAS,
                MAX_NORMAL, SUB_SCALE, SOFT_ROUND, ELEM)
    tl.store(cdata_ptr + rows * C + cols, q, mask=mask)
    s_rows = rb1[:, None, None]
    s_cols = cb1[None, :, None] * 32 + j[None, None, :]
    tl.store(cscale_ptr + s_rows * C + s_cols, byte.to(tl.uint8), mask=(s_rows * 32 < R) & (s_cols < C))


@triton.jit
def _mx_dequant(data_ptr, scale_ptr, out_ptr, R, C, stride_dr, stride_dc, stride_sr, stride_sc,
                stride_or, stride_oc, AXIS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_C: tl.constexpr, ELEM: tl.constexpr):
    """out = element * 2^(byte - 127), blocks along ``AXIS`` of a 2-D (R, C) tensor."""
    pid = tl.program_id(0)
    n_col_tiles = tl.cdiv(C, BLOCK_C)
    rows = ((pid // n_col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)[:, None]
    cols = ((pid % n_col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C))[None, :]
    mask = (rows < R) & (cols < C)
    d = tl.load(data_ptr + rows * stride_dr + cols * stride_dc, mask=mask, other=0)
    if AXIS == 1:
        s = tl.load(scale_ptr + rows * stride_sr + (cols // 32) * stride_sc, mask=mask, other=127)
    else:
        s = tl.load(scale_ptr + (rows // 32) * stride_sr + cols * stride_sc, mask=mask, other=127)
    value = d.to(ELEM, bitcast=True).to(tl.float32) * _scale_factor(s)
    tl.store(out_ptr + rows * stride_or + cols * stride_oc, value.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------- launchers
def _fmt_args(elem: str, scale_rule: str, soft_round: bool | None) -> dict:
    if soft_round is None:
        soft_round = os.environ.get("TRITON_INTERPRET") == "1"
    fmt = FORMATS[elem]
    return dict(EMAX=fmt.emax, RCEIL=scale_rule == "rceil", MBITS=fmt.mbits, EMIN=fmt.emin,
                BIAS=fmt.bias, MAX_NORMAL=fmt.max_normal,
                SUB_SCALE=float(2.0 ** (fmt.mbits - fmt.emin)), SOFT_ROUND=soft_round, ELEM=_TL_ELEM[elem])


#: default tiles: the fastest of `gem bench mx --sweep` on an H200 (2026-12-03: hardware rounding,
#: unmasked whole tiles; persistent grids were slower); tests pin small ones. A tile dict given to
#: quantize_mx_triton picks the kernel: NBLK -> flat, BLOCK_R/NB -> rows, NB/BLOCK_C -> columns
FLAT_TILE = dict(NBLK=128, num_warps=4)  # contiguous rows of whole blocks (the common case)
ROWS_TILE = dict(BLOCK_R=16, NB=16, num_warps=8)  # strided rows or a short last block
COLS_TILE = dict(NB=1, BLOCK_C=128, num_warps=1)  # one warp: a block's 32 rows reduce in-thread
BOTH_TILE = dict(NBR=2, NBC=2, num_warps=2)


def _launch_opts(tile: dict, device: torch.device) -> dict:
    """Kernel arguments of a cast ``tile`` plus ``max_programs``: one program a tile unless the
    tile names ``programs`` (a grid of at most that many) or ``programs_per_sm`` (that many per
    SM of a CUDA device): the programs then loop over the tiles (persistent)."""
    opts = dict(tile)
    per_sm, programs = opts.pop("programs_per_sm", None), opts.pop("programs", None)
    opts.setdefault("STAGES", 1)
    opts["max_programs"] = 2**31 - 1
    if programs is not None:
        opts["max_programs"] = programs
    elif per_sm is not None and device.type == "cuda":
        opts["max_programs"] = per_sm * torch.cuda.get_device_properties(device).multi_processor_count
    return opts


def quantize_mx_triton(x: torch.Tensor, elem: str = "e4m3", block: int = BLOCK, axis: int = -1,
                       scale_rule: str = "floor", soft_round: bool | None = None,
                       tile: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`mx_reference.quantize_mx_reference` (block must be 32).
    ``soft_round`` None: software rounding under the interpreter, the hardware conversion on a GPU."""
    assert block == BLOCK
    fmt = FORMATS[elem]
    axis = axis % x.dim()
    shape = list(x.shape)
    length = shape[axis]
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1:])
    data = torch.empty(shape, dtype=fmt.dtype, device=x.device)
    sshape = shape.copy()
    sshape[axis] = -(-length // BLOCK)
    scale = torch.empty(sshape, dtype=torch.uint8, device=x.device)
    if x.numel() == 0:
        return data, scale
    args = _fmt_args(elem, scale_rule, soft_round)
    d8 = data.view(torch.uint8)
    if inner == 1 and length % BLOCK == 0 and x.is_contiguous() and (tile is None or "NBLK" in tile):
        t = dict(FLAT_TILE, **(tile or {}))  # whole blocks, contiguous: a flat run of blocks
        n_blocks = x.numel() // BLOCK
        grid = (triton.cdiv(n_blocks, t["NBLK"]),)
        _mx_cast_flat[grid](x, d8, scale, n_blocks, **t, **args, EVEN=n_blocks % t["NBLK"] == 0)
    elif inner == 1:  # blocks along the fastest-moving logical axis: rows of (outer, length)
        t = dict(ROWS_TILE, **(tile or {}))
        x2, d2, s2 = x.reshape(outer, length), d8.view(outer, length), scale.view(outer, -1)
        launch, n_tiles = _launch_opts(t, x.device), triton.cdiv(outer, t["BLOCK_R"]) * triton.cdiv(length, t["NB"] * BLOCK)
        grid = (min(n_tiles, launch.pop("max_programs")),)
        even = outer % t["BLOCK_R"] == 0 and length % (t["NB"] * BLOCK) == 0
        _mx_cast_rows[grid](x2, d2, s2, outer, length, *x2.stride(), *d2.stride(), *s2.stride(), **launch,
                            **args, EVEN=even)
    else:  # blocks along the middle axis of (outer, length, inner)
        t = dict(COLS_TILE, **(tile or {}))
        x3, d3, s3 = x.reshape(outer, length, inner), d8.view(outer, length, inner), scale.view(outer, -1, inner)
        if outer > 65535:
            raise ValueError(f"x: at most 65535 slices before axis {axis}, got {outer}")
        launch, n_tiles = _launch_opts(t, x.device), triton.cdiv(length, t["NB"] * BLOCK) * triton.cdiv(inner, t["BLOCK_C"])
        grid = (min(n_tiles, launch.pop("max_programs")), outer)
        even = length % (t["NB"] * BLOCK) == 0 and inner % t["BLOCK_C"] == 0
        _mx_cast_cols[grid](x3, d3, s3, length, inner, *x3.stride(), *d3.stride(), *s3.stride(), **launch,
                            **args, EVEN=even)
    return data, scale


def quantize_mx_both_triton(x: torch.Tensor, elem: str = "e4m3", scale_rule: str = "floor",
                            soft_round: bool | None = None, tile: dict | None = None):
    """2-D ``x`` (R, C) -> ((data, scale) blocked along C, (data, scale) blocked along R), one read."""
    fmt = FORMATS[elem]
    R, C = x.shape
    rdata = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    cdata = torch.empty((R, C), dtype=fmt.dtype, device=x.device)
    rscale = torch.empty((R, -(-C // BLOCK)), dtype=torch.uint8, device=x.device)
    cscale = torch.empty((-(-R // BLOCK), C), dtype=torch.uint8, device=x.device)
    if x.numel():
        t = dict(BOTH_TILE, **(tile or {}))
        grid = (triton.cdiv(R, t["NBR"] * BLOCK) * triton.cdiv(C, t["NBC"] * BLOCK),)
        _mx_cast_both[grid](x, rdata.view(torch.uint8), rscale, cdata.view(torch.uint8), cscale, R, C,
                            *x.stride(), **t, **_fmt_args(elem, scale_rule, soft_round))
    return (rdata, rscale), (cdata, cscale)


def dequantize_mx_triton(data: torch.Tensor, scale: torch.Tensor, axis: int,
                         dtype: torch.dtype = torch.bfloat16, block_r: int = 32,
                         block_c: int = 128, num_warps: int = 4) -> torch.Tensor:
    """2-D MX (data, scale) blocked along ``axis`` -> ``dtype`` (rounded once from float32)."""
    R, C = data.shape
    out = torch.empty((R, C), dtype=dtype, device=data.device)
    if data.numel():
        elem = "e4m3" if data.dtype == torch.float8_e4m3fn else "e5m2"
        grid = (triton.cdiv(R, block_r) * triton.cdiv(C, block_c),)
        _mx_dequant[grid](data.view(torch.uint8), scale, out, R, C, *data.stride(), *scale.stride(),
                          *out.stride(), AXIS=axis % 2, BLOCK_R=block_r, BLOCK_C=block_c,
                          ELEM=_TL_ELEM[elem], num_warps=num_warps)
    return out
