"""Hopper backward of jagged self-attention in Gluon, the companion of the Gluon forward
(``jagged_attention_gluon``): two warp-specialized kernels, no atomics.

Both are persistent, as the forward: one CTA per SM loops over the work items, heaviest first,
and the producer loads an item's resident tiles once the consumers are done with the last ones.

- dQ (runs first): per (sequence, head, 128 query rows). A producer warp
  loads both 64-row halves of Q and dO, then 64-row K/V tiles into a ring; two consumer
  warpgroups own 64 query rows each. Softmax first writes ``delta = rowsum(dO·O)`` for its rows.
  Per key tile: S = Q Kᵀ and dP = dO Vᵀ go out together; dS = P ⊙ (dP − delta) with
  P = exp2(S·scale·log2 e − lse) (softmax) or dS = dP ⊙ act'(scale·S) / norm; dQ += dS K.
- dK/dV: per (sequence, head, 128 key rows), the key tiles seen by the most queries first.
  The producer loads both K/V halves, then 64-row Q/dO tiles into a ring; each consumer
  warpgroup keeps dK and dV of its 64 key rows in registers. Per query tile, with the scores
  transposed (keys x queries): Sᵀ = K Qᵀ and dPᵀ = V dOᵀ go out together; dV += Pᵀ dO goes out
  while dSᵀ is computed; dK += dSᵀ Q.
dQ and dK are scaled by ``scale`` once at the end.

Scope: the forward's (:func:`jagged_attention_gluon.unsupported_reason`), with dO's heads packed
in rows too (the launcher copies it otherwise). Reads the forward's output and base-2 LSE.
"""
from __future__ import annotations

import math
import os

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from gemcore.kernels.jagged_attention_gluon import (_BLOCK_M, _CONSUMER_REGS, _OPTIONS, _PRODUCER_REGS, _allowed,
                                                    _dealt, _listed, _pointwise_and_grad, _ring_barriers,
                                                    _stream_tiles, _tma_load, _work_item, descriptor, on_hopper,
                                                    packed_rows, sm_count, unsupported_reason)
from gemcore.kernels.jagged_attention_triton_common import ACTIVATION_CODES
from gemcore.kernels.jagged_work_list import cached_lists
from gemcore.kernels.kernel_launch import LaunchCache

#: (rows per CTA, rows per ring slot, ring slots) of the two kernels. dQ: 128 query rows, 64-row
#: K/V tiles, 3 slots; dK/dV: 128 key rows, 64-row Q/dO tiles, 2 slots (3 timed the same on the H200)
DQ_TILE = (128, 64, 3)
DKDV_TILE = (128, 64, 2)
#: the Triton backward is kept for mean lengths below this (the Gluon one measured faster at mean
#: 494 and 1945, both kinds; shorter ones are not measured)
MIN_MEAN_LEN = 256


@gluon.jit
def _load_halves(a_desc, b_desc, a_smem, b_smem, bar, first_row, col):
    """Producer prologue: both 64-row halves of the resident tiles of a and b (rows
    [first_row, first_row + 128), columns [col, col + D)), all four signalled on ``bar``."""
    HALF: gl.constexpr = a_smem.type.shape[1]
    mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(a_desc, [first_row + half * HALF, col], bar, a_smem.index(half))
        _tma_load(b_desc, [first_row + half * HALF, col], bar, b_smem.index(half))


@gluon.jit
def _buffers(a_desc, b_desc, c_desc, d_desc, STAGES: gl.constexpr):
    """Shared memory of a backward kernel: both 64-row halves of its two resident tiles (a, b),
    STAGES ring slots of its two streamed ones (c, d), and their barriers: (a_smem, b_smem,
    c_ring, d_ring, resident_ready (the halves landed), resident_free (both consumers are done
    with them), c_ready, d_ready, empty)."""
    gl.static_assert(a_desc.block_type.shape[0] == 64)
    a_smem = gl.allocate_shared_memory(a_desc.dtype, [2] + a_desc.block_type.shape, a_desc.layout)
    b_smem = gl.allocate_shared_memory(b_desc.dtype, [2] + b_desc.block_type.shape, b_desc.layout)
    c_ring = gl.allocate_shared_memory(c_desc.dtype, [STAGES] + c_desc.block_type.shape, c_desc.layout)
    d_ring = gl.allocate_shared_memory(d_desc.dtype, [STAGES] + d_desc.block_type.shape, d_desc.layout)
    resident_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    resident_free = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(resident_ready, count=1)
    mbarrier.init(resident_free, count=2)
    c_ready, d_ready, empty = _ring_barriers(STAGES)
    return a_smem, b_smem, c_ring, d_ring, resident_ready, resident_free, c_ready, d_ready, empty


@gluon.jit
def _release_unread(ready, empty, tile):
    """A consumer's release of a ring tile it does not read: once the tile has landed (so the
    slot's previous tile was released by both consumers), arrive on its empty barrier."""
    STAGES: gl.constexpr = empty.type.shape[0]
    mbarrier.wait(ready.index(tile % STAGES), (tile // STAGES) & 1)
    mbarrier.arrive(empty.index(tile % STAGES), count=1)


# --------------------------------------------------------------------------- dQ
@gluon.jit
def _dq_item(wg: gl.constexpr, q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty,
             DQ, O, LSE2, DELTA, start, seq_len, history, m0, h, H, stride_t, stride_o, scale, qk_scale,
             inv_norm, n_full, n_tiles, base, item, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
             HAS_TARGETS: gl.constexpr):
    """One work item: query rows [m0 + 64·wg, +64) against key tiles 0 .. n_tiles - 1 (ring
    slots from ``base`` on; ``item``: the CTA's items before); tiles from n_full on masked."""
    WG_M: gl.constexpr = q_smem.type.shape[1]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    BLOCK_N: gl.constexpr = k_ring.type.shape[1]
    D: gl.constexpr = k_ring.type.shape[2]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < seq_len
    mbarrier.wait(qdo_bar, item & 1)
    if ACTIVATION == 0:
        # delta = rowsum(dO·O) of these rows, stored for the dK/dV kernel
        io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        io_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, io))
        io_cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        o = gl.load(O + h * D + (start + io_rows)[:, None] * stride_o + io_cols[None, :],
                    mask=(io_rows < seq_len)[:, None], other=0.0).to(gl.float32)
        do = do_smem.index(wg).load(io).to(gl.float32)
        delta = gl.convert_layout(gl.sum(o * do, 1), gl.SliceLayout(1, s_layout))
        gl.store(DELTA + (start + rows) * H + h, delta, mask=row_ok)
        lse = gl.load(LSE2 + (start + rows) * H + h, mask=row_ok, other=float("inf"))
    q_w = q_smem.index(wg)
    do_w = do_smem.index(wg)
    dq = gl.zeros([WG_M, D], gl.float32, acc_layout)
    n_mine = n_tiles
    if CAUSAL and wg == 0:                        # its rows end before the diagonal's second key tile
        n_mine = gl.minimum(n_tiles, gl.cdiv(m0 + WG_M, BLOCK_N))
    for j in range(n_mine):
        stage = (base + j) % STAGES
        phase = ((base + j) // STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        s_tok = warpgroup_mma(q_w, k_ring.index(stage).permute((1, 0)),
                              gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp_tok = warpgroup_mma(do_w, v_ring.index(stage).permute((1, 0)),
                               gl.zeros([WG_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        keys = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        allowed = _allowed(rows[:, None], keys[None, :], seq_len, history, CAUSAL, HAS_TARGETS)
        if ACTIVATION == 0:
            p = gl.exp2(s * qk_scale - lse[:, None])
            if j >= n_full:
                p = gl.where(allowed, p, 0.0)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = p * (dp - delta[:, None])
        else:
            _, g = _pointwise_and_grad(s * scale, ACTIVATION)
            g = g * inv_norm
            if j >= n_full:
                g = gl.where(allowed, g, 0.0)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = dp * g
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(k_ring.dtype), op_layout), k_ring.index(stage), dq,
                               is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(empty.index(stage), count=1)
    if n_mine < n_tiles:                           # the skipped tile: released once it has landed
        _release_unread(v_ready, empty, base + n_tiles - 1)
    mbarrier.arrive(qdo_free, count=1)            # Q and dO are read: the producer may load the next
    o_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    gl.store(DQ + h * D + (start + o_rows)[:, None] * stride_t + cols[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(o_rows < seq_len)[:, None])


@gluon.jit
def _dq_consumer(wg: gl.constexpr, q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty,
                 DQ, O, LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t, stride_o, scale,
                 qk_scale, inv_norm, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """One warpgroup: its 64 query rows of every work item of this CTA (:func:`_dq_item`)."""
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, m0, start, seq_len, _, _, history, n_full, n_tiles = _work_item(
                w, work, n_seq, None, num_targets, H, CAUSAL, HAS_TARGETS, False, k_ring.type.shape[1])
            _dq_item(wg, q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, DQ, O,
                     LSE2, DELTA, start, seq_len, history, m0, h, H, stride_t, stride_o, scale, qk_scale,
                     inv_norm, n_full, n_tiles, base, item, ACTIVATION, CAUSAL, HAS_TARGETS)
            base += n_tiles
            item += 1


@gluon.jit
def _dq_second_consumer(q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, q_desc,
                        do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, H, work, n_listed, n_seq,
                        stride_t, stride_o, scale, qk_scale, inv_norm, ACTIVATION: gl.constexpr,
                        CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """Worker partition: the consumer of query rows 64..127 (workers share one signature)."""
    _dq_consumer(1, q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, DQ, O, LSE2,
                 DELTA, num_targets, H, work, n_listed, n_seq, stride_t, stride_o, scale, qk_scale, inv_norm,
                 ACTIVATION, CAUSAL, HAS_TARGETS)


@gluon.jit
def _dq_producer(q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, q_desc, do_desc,
                 k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t,
                 stride_o, scale, qk_scale, inv_norm, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
                 HAS_TARGETS: gl.constexpr):
    """Worker partition, one warp: per work item, both halves of Q and dO (once the consumers
    are done with the last ones), then its K/V tiles into the ring."""
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, m0, start, seq_len, _, _, history, n_full, n_tiles = _work_item(
                w, work, n_seq, None, num_targets, H, CAUSAL, HAS_TARGETS, False, k_ring.type.shape[1])
            col = h * k_ring.type.shape[2]
            mbarrier.wait(qdo_free, (item & 1) ^ 1)      # fresh barrier: passes
            _load_halves(q_desc, do_desc, q_smem, do_smem, qdo_bar, start + m0, col)
            _stream_tiles(k_desc, v_desc, k_ring, v_ring, k_ready, v_ready, empty, start, n_tiles, col, base)
            base += n_tiles
            item += 1


@gluon.jit
def _jagged_attn_bwd_dq_hopper(q_desc, do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets,
                               stride_t, stride_o, H, work, n_listed, n_seq, scale, qk_scale, inv_norm,
                               STAGES: gl.constexpr, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
                               HAS_TARGETS: gl.constexpr, PERSISTENT: gl.constexpr):
    """Over the forward's work items (``work``: its list, :func:`_work_item`), persistent or one
    CTA per possible item (one past the list returns at once), as the forward. Descriptors over (T, H·D)
    row views: q / dO in (64, D) blocks, k / v in (BLOCK_N, D). DQ (T, H, D) with row stride
    stride_t; O (T, H, D) with row stride stride_o (softmax only); LSE2, DELTA (T, H) float32."""
    if PERSISTENT:
        active = True
    else:
        active = gl.program_id(0) < gl.load(n_listed) * H
    if active:
        _dq_partitions(q_desc, do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, stride_t, stride_o,
                       H, work, n_listed, n_seq, scale, qk_scale, inv_norm, STAGES, ACTIVATION, CAUSAL, HAS_TARGETS)


@gluon.jit
def _dq_partitions(q_desc, do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, stride_t, stride_o,
                   H, work, n_listed, n_seq, scale, qk_scale, inv_norm, STAGES: gl.constexpr, ACTIVATION: gl.constexpr,
                   CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """Shared memory, barriers and the three partitions of :func:`_jagged_attn_bwd_dq_hopper`."""
    q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty = _buffers(
        q_desc, do_desc, k_desc, v_desc, STAGES)
    # the argument tuples are written out: a tuple bound to a name first loses its constexprs
    gl.warp_specialize([
        (_dq_consumer, (0, q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, DQ, O,
                        LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t, stride_o, scale,
                        qk_scale, inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS)),
        (_dq_second_consumer, (q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty,
                               q_desc, do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, H,
                               work, n_listed, n_seq, stride_t, stride_o, scale, qk_scale, inv_norm, ACTIVATION,
                               CAUSAL, HAS_TARGETS)),
        (_dq_producer, (q_smem, do_smem, k_ring, v_ring, qdo_bar, qdo_free, k_ready, v_ready, empty, q_desc,
                        do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, num_targets, H, work, n_listed, n_seq,
                        stride_t, stride_o, scale, qk_scale, inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


# --------------------------------------------------------------------------- dK/dV
@gluon.jit
def _dkdv_item(wg: gl.constexpr, k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty,
               DK, DV, LSE2, DELTA, start, seq_len, history, n0, h, H, stride_t, scale, qk_scale,
               inv_norm, i0, n_iters, base, item, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
               HAS_TARGETS: gl.constexpr):
    """One work item: key rows [n0 + 64·wg, +64) against query tiles i0 .. i0 + n_iters - 1
    (ring slots from ``base`` on; ``item``: the CTA's items before)."""
    WG_N: gl.constexpr = k_smem.type.shape[1]
    STAGES: gl.constexpr = q_ring.type.shape[0]
    BLOCK_M: gl.constexpr = q_ring.type.shape[1]
    D: gl.constexpr = k_smem.type.shape[2]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    k_w = k_smem.index(wg)
    v_w = v_smem.index(wg)
    key0 = n0 + wg * WG_N
    keys = key0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([WG_N, D], gl.float32, acc_layout)
    dv = gl.zeros([WG_N, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, item & 1)
    first = 0
    if CAUSAL and wg == 1 and BLOCK_M == WG_N:    # its keys come after the first query tile's rows
        if n_iters > 0:
            _release_unread(do_ready, empty, base)
            first = 1
    for it in range(first, n_iters):
        m0 = (i0 + it) * BLOCK_M
        stage = (base + it) % STAGES
        phase = ((base + it) // STAGES) & 1
        queries = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        q_ok = queries < seq_len
        if ACTIVATION == 0:
            # loaded one element per thread, then spread to the scores' columns: loading in the
            # scores' layout holds a pointer per replicated element (register spills)
            flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
            q_flat = m0 + gl.arange(0, BLOCK_M, layout=flat)
            at = (start + q_flat) * H + h
            # converted to the scores' layout only where each is used: converted here, both stay
            # live across the wgmma waits (ptxas: 180 B of spills against 20, Triton 3.6)
            lse = gl.load(LSE2 + at, mask=q_flat < seq_len, other=float("inf"))
            delta = gl.load(DELTA + at, mask=q_flat < seq_len, other=0.0)
        mbarrier.wait(q_ready.index(stage), phase)
        st_tok = warpgroup_mma(k_w, q_ring.index(stage).permute((1, 0)),
                               gl.zeros([WG_N, BLOCK_M], gl.float32, st_layout), use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dpt_tok = warpgroup_mma(v_w, do_ring.index(stage).permute((1, 0)),
                                gl.zeros([WG_N, BLOCK_M], gl.float32, st_layout), use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        # masked: the sequence's last query tile; causal, the diagonal's; with targets, candidates'
        masked = m0 + BLOCK_M > seq_len
        if CAUSAL:
            masked = masked | (m0 < key0 + WG_N)
            if HAS_TARGETS:
                masked = masked | (m0 + BLOCK_M > history)
        allowed = _allowed(queries[None, :], keys[:, None], seq_len, history, CAUSAL, HAS_TARGETS) & q_ok[None, :]
        if ACTIVATION == 0:
            lse = gl.convert_layout(lse, gl.SliceLayout(0, st_layout))
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if masked:
                pt = gl.where(allowed, pt, 0.0)
        else:
            pt, gt = _pointwise_and_grad(st * scale, ACTIVATION)
            pt = pt * inv_norm
            gt = gt * inv_norm
            if masked:
                pt = gl.where(allowed, pt, 0.0)
                gt = gl.where(allowed, gt, 0.0)
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(k_smem.dtype), op_layout), do_ring.index(stage), dv,
                               is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        if ACTIVATION == 0:
            delta = gl.convert_layout(delta, gl.SliceLayout(0, st_layout))
            dst = pt * (dpt - delta[None, :])
        else:
            dst = dpt * gt
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(k_smem.dtype), op_layout), q_ring.index(stage), dk,
                               is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(empty.index(stage), count=1)
    mbarrier.arrive(kv_free, count=1)             # K and V are read: the producer may load the next
    rows = key0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = h * D + (start + rows)[:, None] * stride_t + cols[None, :]
    ok = (rows < seq_len)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def _dkdv_item_bounds(w, work, n_seq, num_targets, H, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr,
                      HAS_TARGETS: gl.constexpr):
    """dK/dV's work index w of the list (:func:`_listed`; key tiles, those seen by the most queries
    first) -> (h, n0, start, seq_len, history, i0, n_iters): key rows [n0, n0 + 128) of head h
    against query tiles i0 .. i0 + n_iters - 1 (BLOCK_M rows each)."""
    t, b, h, start, seq_len, history = _listed(work, w, H, n_seq, num_targets, HAS_TARGETS)
    n0 = t * _BLOCK_M
    i0 = 0
    i_end = gl.cdiv(seq_len, BLOCK_M)
    if CAUSAL:
        i0 = n0 // BLOCK_M                         # queries from the key tile's first row on
        if HAS_TARGETS:
            if n0 >= history:                      # candidates' keys: each seen by its own row only
                i_end = gl.cdiv(gl.minimum(n0 + _BLOCK_M, seq_len), BLOCK_M)
    return h, n0, start, seq_len, history, i0, i_end - i0


@gluon.jit
def _dkdv_consumer(wg: gl.constexpr, k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty,
                   DK, DV, LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t, scale, qk_scale,
                   inv_norm, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """One warpgroup: its 64 key rows of every work item of this CTA (:func:`_dkdv_item`)."""
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, n0, start, seq_len, history, i0, n_iters = _dkdv_item_bounds(
                w, work, n_seq, num_targets, H, q_ring.type.shape[1], CAUSAL, HAS_TARGETS)
            _dkdv_item(wg, k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, DK, DV,
                       LSE2, DELTA, start, seq_len, history, n0, h, H, stride_t, scale, qk_scale, inv_norm, i0,
                       n_iters, base, item, ACTIVATION, CAUSAL, HAS_TARGETS)
            base += n_iters
            item += 1


@gluon.jit
def _dkdv_second_consumer(k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, k_desc,
                          v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, H, work, n_listed, n_seq,
                          stride_t, scale, qk_scale, inv_norm, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
                          HAS_TARGETS: gl.constexpr):
    """Worker partition: the consumer of key rows 64..127 (workers share one signature)."""
    _dkdv_consumer(1, k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, DK, DV, LSE2,
                   DELTA, num_targets, H, work, n_listed, n_seq, stride_t, scale, qk_scale, inv_norm,
                   ACTIVATION, CAUSAL, HAS_TARGETS)


@gluon.jit
def _dkdv_producer(k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, k_desc, v_desc,
                   q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t,
                   scale, qk_scale, inv_norm, ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr,
                   HAS_TARGETS: gl.constexpr):
    """Worker partition, one warp: per work item, both K/V halves (once the consumers are done
    with the last ones), then its Q and dO tiles into the ring."""
    BLOCK_M: gl.constexpr = q_ring.type.shape[1]
    base = 0
    item = 0
    n_work = gl.load(n_listed) * H
    for r in range(gl.cdiv(n_work, gl.num_programs(0))):
        w = _dealt(r)
        if w < n_work:
            h, n0, start, seq_len, history, i0, n_iters = _dkdv_item_bounds(
                w, work, n_seq, num_targets, H, BLOCK_M, CAUSAL, HAS_TARGETS)
            col = h * k_smem.type.shape[2]
            mbarrier.wait(kv_free, (item & 1) ^ 1)       # fresh barrier: passes
            _load_halves(k_desc, v_desc, k_smem, v_smem, kv_bar, start + n0, col)
            _stream_tiles(q_desc, do_desc, q_ring, do_ring, q_ready, do_ready, empty, start + i0 * BLOCK_M,
                          n_iters, col, base)
            base += n_iters
            item += 1


@gluon.jit
def _jagged_attn_bwd_dkdv_hopper(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets,
                                 stride_t, H, work, n_listed, n_seq, scale, qk_scale, inv_norm, STAGES: gl.constexpr,
                                 ACTIVATION: gl.constexpr, CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr,
                                 PERSISTENT: gl.constexpr):
    """Over the work items of ``work`` (key tiles, listed from each sequence's end:
    :func:`_dkdv_item_bounds`), persistent or one CTA per possible item, as the forward.
    Descriptors over (T, H·D) row views: k / v in (64, D) blocks, q / dO in (BLOCK_M, D).
    DK, DV (T, H, D) with row stride stride_t; LSE2, DELTA (T, H) float32 (softmax only)."""
    if PERSISTENT:
        active = True
    else:
        active = gl.program_id(0) < gl.load(n_listed) * H
    if active:
        _dkdv_partitions(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, stride_t, H,
                         work, n_listed, n_seq, scale, qk_scale, inv_norm, STAGES, ACTIVATION, CAUSAL, HAS_TARGETS)


@gluon.jit
def _dkdv_partitions(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, stride_t, H,
                     work, n_listed, n_seq, scale, qk_scale, inv_norm, STAGES: gl.constexpr, ACTIVATION: gl.constexpr,
                     CAUSAL: gl.constexpr, HAS_TARGETS: gl.constexpr):
    """Shared memory, barriers and the three partitions of :func:`_jagged_attn_bwd_dkdv_hopper`."""
    k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty = _buffers(
        k_desc, v_desc, q_desc, do_desc, STAGES)
    gl.warp_specialize([
        (_dkdv_consumer, (0, k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, DK, DV,
                          LSE2, DELTA, num_targets, H, work, n_listed, n_seq, stride_t, scale, qk_scale,
                          inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS)),
        (_dkdv_second_consumer, (k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty,
                                 k_desc, v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, H,
                                 work, n_listed, n_seq, stride_t, scale, qk_scale, inv_norm, ACTIVATION, CAUSAL,
                                 HAS_TARGETS)),
        (_dkdv_producer, (k_smem, v_smem, q_ring, do_ring, kv_bar, kv_free, q_ready, do_ready, empty, k_desc,
                          v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, num_targets, H, work, n_listed, n_seq,
                          stride_t, scale, qk_scale, inv_norm, ACTIVATION, CAUSAL, HAS_TARGETS)),
    ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


# --------------------------------------------------------------------------- host side
def gluon_backward_applies(q, k, v, offsets, kv_offsets, num_targets, causal: bool, window_left: int,
                           window_right: int) -> bool:
    """Whether the Triton backend's backward should run here: an sm_90 GPU, inputs in the
    forward's scope, a mean length of at least MIN_MEAN_LEN, and neither GEMCORE_GLUON_ATTENTION
    nor GEMCORE_GLUON_ATTENTION_BWD set to 0."""
    if "0" in (os.environ.get("GEMCORE_GLUON_ATTENTION", "1"), os.environ.get("GEMCORE_GLUON_ATTENTION_BWD", "1")):
        return False
    if not on_hopper(q) or kv_offsets is not None:       # self-attention only
        return False
    if unsupported_reason(q, k, v, offsets, kv_offsets, num_targets, causal, window_left, window_right):
        return False
    return q.shape[0] >= MIN_MEAN_LEN * (offsets.numel() - 1)


def _row_view(x: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) itself if TMA can read it (:func:`jagged_attention_gluon.packed_rows`), else a
    contiguous copy."""
    return x if packed_rows(x) else x.contiguous()


#: the two kernels' compiled binaries, launched without the JIT's per-call binding (kernel_launch)
_DQ_LAUNCHES = LaunchCache(_jagged_attn_bwd_dq_hopper)
_DKDV_LAUNCHES = LaunchCache(_jagged_attn_bwd_dkdv_hopper)


def jagged_attention_bwd_hopper(do, q, k, v, out, lse2, offsets, activation: str, causal: bool, scale: float,
                                inv_norm: float, max_seqlen: int, num_targets=None, *, persistent: bool = True):
    """(dq, dk, dv), each (T, H, D) contiguous in q's dtype, of the Gluon / Triton forward's
    (out, lse2). Inputs as :func:`jagged_attention_gluon.unsupported_reason` accepts; do (T, H, D)
    any layout; offsets (B+1,) int64 and num_targets (B,) int64 (causal only) on the GPU.
    ``persistent``: one CTA per SM looping over the work items (default), else one per item."""
    T, H, D = q.shape
    B = offsets.numel() - 1
    dq, dk, dv = (torch.empty(T, H, D, device=q.device, dtype=q.dtype) for _ in range(3))
    if B * H == 0 or T == 0 or max_seqlen == 0:
        return dq, dk, dv
    do = _row_view(do)
    softmax = activation == "softmax"
    if softmax:
        out = _row_view(out)
    delta = torch.empty(T if softmax else 0, H, device=q.device, dtype=torch.float32)
    qk_scale = scale * 1.4426950408889634
    flags = dict(ACTIVATION=ACTIVATION_CODES[activation], CAUSAL=bool(causal),
                 HAS_TARGETS=num_targets is not None, PERSISTENT=persistent)
    targets = offsets if num_targets is None else num_targets
    n_items = B * H * math.ceil(max_seqlen / 128)  # at most: 128-row tiles of the longest sequence
    ctas = min(n_items, sm_count(q.device)) if persistent else n_items
    # query tiles for dQ (the forward's list, kept on the offsets), key tiles for dK/dV
    (q_work, q_listed), (k_work, k_listed) = cached_lists(offsets, max_seqlen, T, query=True, key=True)
    # both kernels read q, do, k and v in (64, D) blocks and in their tile's (slot, D) blocks: one
    # descriptor per tensor and block shape serves both launches (each costs microseconds of host time)
    descs = {rows: dict(zip("qdkv", (descriptor(t, rows) for t in (q, do, k, v))))
             for rows in dict.fromkeys((64, DQ_TILE[1], DKDV_TILE[1]))}
    _, slot, stages = DQ_TILE
    _DQ_LAUNCHES.launch(
        (ctas,),
        (descs[64]["q"], descs[64]["d"], descs[slot]["k"], descs[slot]["v"],
         dq, out, lse2, delta, targets, dq.stride(0), out.stride(0), H, q_work, q_listed, B, scale, qk_scale,
         inv_norm),
        dict(STAGES=stages, **flags), _OPTIONS)
    _, slot, stages = DKDV_TILE
    _DKDV_LAUNCHES.launch(
        (ctas,),
        (descs[64]["k"], descs[64]["v"], descs[slot]["q"], descs[slot]["d"],
         dk, dv, lse2, delta, targets, dk.stride(0), H, k_work, k_listed, B, scale, qk_scale, inv_norm),
        dict(STAGES=stages, **flags), _OPTIONS)
    return dq, dk, dv
