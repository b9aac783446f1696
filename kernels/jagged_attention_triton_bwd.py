"""Triton jagged attention backward without atomics: dQ with one program per query tile (it
runs first and, for softmax, also computes and stores ``delta = rowsum(dO * O)`` from the tiles
it loads anyway), then dK/dV with one program per key tile (looping over the query tiles that
see it). Both recompute the scores: 7 MMAs per tile pair instead of the 5 of a fused backward,
which would need dQ atomics (or O(L^2) memory for dS).
"""
from __future__ import annotations

import triton
import triton.language as tl

from gemcore.kernels.jagged_attention_triton_common import (
    _act_and_grad,
    _allowed,
    _full_keys,
    _full_queries,
    _key_range,
    _part,
    _query_range,
    _sequence,
)


@triton.jit
def _dkdv_loop(dk, dv, k, v, q_base, do_base, LSE2, DELTA, offs_n, lo, hi, o_start, H, h,
               stride_qt, stride_dot, q_len, kv_len, history, left, right, scale, qk_scale,
               inv_norm, D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, ACTIVATION: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr, MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
               FAST_ACT: tl.constexpr):
    """Query tiles [lo, hi) seeing one key tile (scores transposed: keys x queries)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + offs_m0
        if MASKED:
            m_ok = offs_m < q_len
        else:
            m_ok = offs_m >= 0
        q = tl.load(q_base + offs_m[:, None] * stride_qt + offs_dqk[None, :],
                    mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        do = tl.load(do_base + offs_m[:, None] * stride_dot + offs_dv[None, :],
                     mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        st = tl.dot(k, tl.trans(q), input_precision=INPUT_PRECISION)  # (BLOCK_N, BLOCK_M)
        dpt = tl.dot(v, tl.trans(do), input_precision=INPUT_PRECISION)
        if ACTIVATION == 0:
            lse2 = tl.load(LSE2 + (o_start + offs_m) * H + h, mask=m_ok, other=float("inf"))
            delta = tl.load(DELTA + (o_start + offs_m) * H + h, mask=m_ok, other=0.0)
            pt = tl.math.exp2(st * qk_scale - lse2[None, :])
            if MASKED:
                allowed = _allowed(offs_m[None, :], offs_n[:, None], q_len, kv_len, history,
                                   left, right, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
                pt = tl.where(allowed, pt, 0.0)
            dst = pt * (dpt - delta[None, :])
        else:
            act, act_grad = _act_and_grad(st * scale, ACTIVATION, FAST_ACT)
            pt = act * inv_norm
            dst = dpt * act_grad * inv_norm
            if MASKED:
                allowed = _allowed(offs_m[None, :], offs_n[:, None], q_len, kv_len, history,
                                   left, right, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
                pt = tl.where(allowed, pt, 0.0)
                dst = tl.where(allowed, dst, 0.0)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=INPUT_PRECISION)
        dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=INPUT_PRECISION)
    return dk, dv


@triton.jit
def _jagged_attn_bwd_dkdv(
    Q, K, V, DO, LSE2, DELTA, DK, DV, q_offsets, kv_offsets, num_targets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
    stride_dkt, stride_dkh, stride_dvt, stride_dvh,
    H, NQ_POOLED, scale, inv_norm, left, right,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, POOLED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    """One key tile per program: loops over the query tiles that see it; no atomics.
    Key tiles go in their natural order, first tiles first: under a causal mask the first key
    tiles are seen by the most query tiles, so the heaviest programs are dispatched first and the
    light ones fill the tail (the reversed order of the other two kernels would do the opposite)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    n0 = tl.program_id(1) * BLOCK_N
    q_start, o_start, q_len, kv_start, kv_len, history = _sequence(
        b, q_offsets, kv_offsets, num_targets, NQ_POOLED, POOLED, HAS_TARGETS)
    if n0 >= kv_len:
        return
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n[:, None] < kv_len
    k = tl.load(K + (kv_start + offs_n[:, None]) * stride_kt + h * stride_kh + offs_dqk[None, :],
                mask=n_ok & (offs_dqk[None, :] < D_QK), other=0.0)
    v = tl.load(V + (kv_start + offs_n[:, None]) * stride_vt + h * stride_vh + offs_dv[None, :],
                mask=n_ok & (offs_dv[None, :] < D_V), other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_DQK), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    q_base = Q + q_start * stride_qt + h * stride_qh
    do_base = DO + o_start * stride_dot + h * stride_doh
    lo, hi = _query_range(n0, q_len, history, left, right, BLOCK_M, BLOCK_N, CAUSAL, HAS_TARGETS,
                          HAS_LEFT, HAS_RIGHT)
    f_lo, f_hi = _full_queries(n0, lo, hi, q_len, kv_len, history, left, right, BLOCK_M, BLOCK_N,
                               CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
    for part in tl.static_range(3):
        p_lo, p_hi = _part(part, lo, f_lo, f_hi, hi)
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, LSE2, DELTA, offs_n, p_lo, p_hi, o_start, H, h,
            stride_qt, stride_dot, q_len, kv_len, history, left, right, scale, qk_scale, inv_norm,
            D_QK, D_V, BLOCK_DQK, BLOCK_DV, BLOCK_M, ACTIVATION, CAUSAL, HAS_TARGETS, HAS_LEFT,
            HAS_RIGHT, part != 0, INPUT_PRECISION, FAST_ACT)
    dk = dk * scale
    tl.store(DK + (kv_start + offs_n[:, None]) * stride_dkt + h * stride_dkh + offs_dqk[None, :],
             dk.to(DK.dtype.element_ty), mask=n_ok & (offs_dqk[None, :] < D_QK))
    tl.store(DV + (kv_start + offs_n[:, None]) * stride_dvt + h * stride_dvh + offs_dv[None, :],
             dv.to(DV.dtype.element_ty), mask=n_ok & (offs_dv[None, :] < D_V))


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, k_base, v_base, offs_m, lo, hi, stride_kt, stride_vt, q_len,
             kv_len, history, left, right, scale, qk_scale, inv_norm, D_QK: tl.constexpr,
             D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_N: tl.constexpr, ACTIVATION: tl.constexpr, CAUSAL: tl.constexpr,
             HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
             MASKED: tl.constexpr, INPUT_PRECISION: tl.constexpr, FAST_ACT: tl.constexpr):
    """Key tiles [lo, hi) of one query tile, accumulating dS K."""
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_n0
        if MASKED:
            n_ok = offs_n < kv_len
        else:
            n_ok = offs_n >= 0
        k = tl.load(k_base + offs_n[:, None] * stride_kt + offs_dqk[None, :],
                    mask=n_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
        vt = tl.load(v_base + offs_n[None, :] * stride_vt + offs_dv[:, None],
                     mask=n_ok[None, :] & (offs_dv[:, None] < D_V), other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION)
        dp = tl.dot(do, vt, input_precision=INPUT_PRECISION)
        if ACTIVATION == 0:
            p = tl.math.exp2(s * qk_scale - lse2[:, None])
            ds = p * (dp - delta[:, None])
        else:
            _, act_grad = _act_and_grad(s * scale, ACTIVATION, FAST_ACT)
            ds = dp * act_grad * inv_norm
        if MASKED:
            allowed = _allowed(offs_m[:, None], offs_n[None, :], q_len, kv_len, history,
                               left, right, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
            ds = tl.where(allowed, ds, 0.0)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=INPUT_PRECISION)
    return dq


@triton.jit
def _jagged_attn_bwd_dq(
    Q, K, V, O, DO, LSE2, DELTA, DQ, q_offsets, kv_offsets, num_targets,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_dot, stride_doh, stride_dqt, stride_dqh,
    H, NQ_POOLED, n_m_tiles, scale, inv_norm, left, right,
    D_QK: tl.constexpr, D_V: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ACTIVATION: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, POOLED: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    FAST_ACT: tl.constexpr,
):
    """One query tile per program: loops over its key tiles. DQ rows follow the output rows.
    Softmax: writes DELTA = rowsum(dO * O) (float32) for the dK/dV kernel that runs after it."""
    pid_bh = tl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (n_m_tiles - 1 - tl.program_id(1)) * BLOCK_M
    q_start, o_start, q_len, kv_start, kv_len, history = _sequence(
        b, q_offsets, kv_offsets, num_targets, NQ_POOLED, POOLED, HAS_TARGETS)
    if m0 >= q_len:
        return
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dqk = tl.arange(0, BLOCK_DQK)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < q_len
    q = tl.load(Q + (q_start + offs_m[:, None]) * stride_qt + h * stride_qh + offs_dqk[None, :],
                mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK), other=0.0)
    do = tl.load(DO + (o_start + offs_m[:, None]) * stride_dot + h * stride_doh + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
    if ACTIVATION == 0:
        lse2 = tl.load(LSE2 + (o_start + offs_m) * H + h, mask=m_ok, other=float("inf"))
        o = tl.load(O + (o_start + offs_m[:, None]) * stride_ot + h * stride_oh + offs_dv[None, :],
                    mask=m_ok[:, None] & (offs_dv[None, :] < D_V), other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + (o_start + offs_m) * H + h, delta, mask=m_ok)
    else:
        lse2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
        delta = lse2
    qk_scale = scale * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, BLOCK_DQK), dtype=tl.float32)
    k_base = K + kv_start * stride_kt + h * stride_kh
    v_base = V + kv_start * stride_vt + h * stride_vh
    lo, hi = _key_range(m0, kv_len, history, left, right, BLOCK_M, BLOCK_N, CAUSAL, HAS_TARGETS,
                        HAS_LEFT, HAS_RIGHT)
    f_lo, f_hi = _full_keys(m0, lo, hi, q_len, kv_len, history, left, right, BLOCK_M, BLOCK_N,
                            CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT)
    for part in tl.static_range(3):
        p_lo, p_hi = _part(part, lo, f_lo, f_hi, hi)
        dq = _dq_loop(
            dq, q, do, lse2, delta, k_base, v_base, offs_m, p_lo, p_hi, stride_kt, stride_vt,
            q_len, kv_len, history, left, right, scale, qk_scale, inv_norm, D_QK, D_V, BLOCK_DQK,
            BLOCK_DV, BLOCK_N, ACTIVATION, CAUSAL, HAS_TARGETS, HAS_LEFT, HAS_RIGHT, part != 0,
            INPUT_PRECISION, FAST_ACT)
    dq = dq * scale
    tl.store(DQ + (o_start + offs_m[:, None]) * stride_dqt + h * stride_dqh + offs_dqk[None, :],
             dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_dqk[None, :] < D_QK))
