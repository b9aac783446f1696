"""Prototype, NOT part of gemcore and never run on a GPU: the dQ kernel of the jagged attention
backward in Gluon for Hopper, the companion of ``gluon_attn_bwd_prototype.py`` (dK/dV). Together
they would replace both Triton backward kernels; as there, no atomics: dQ has its own kernel.

One CTA per (sequence, head, 128 query rows), as the forward: a TMA producer warp loads both
64-row halves of Q and dO once, then K/V tiles of 64 rows into a ring; two consumer warpgroups own
64 query rows each. Softmax first computes ``delta = rowsum(dO·O)`` for its rows and stores it for
the dK/dV kernel (as gemcore's Triton dQ kernel does). Per key tile: S = Q Kᵀ and dP = dO Vᵀ go
out together, P = exp2(S·scale·log2 e − lse) (or act(scale·S)), dS = P ⊙ (dP − delta) (or dP ⊙
act'/norm), dQ += dS K; at the end dQ ·= scale.
Scope: bf16, D = 128, causal self-attention, softmax or silu, no targets or window.

    python scripts/gluon_attn_bwd_dq_prototype.py --emulate        # the schedule in PyTorch, on a CPU
    python scripts/gluon_attn_bwd_dq_prototype.py --compile-only   # AOT for sm_90: registers, spills
    python scripts/gluon_attn_bwd_dq_prototype.py                  # on an H100/H200: parity + timing
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from gemcore.kernels.jagged_attention_gluon import _tma_load   # the TMA load under both Triton names

from gluon_attn_bwd_prototype import _sigmoid_fast   # the modules beside this one
from gluon_bwd_harness import (HEAD_D, aot_compile, lse2_delta, parity_lengths, problem, reference,
                               relative_error, time_beside_triton_backward)


BLOCK_M = 128          # query rows per CTA: two consumer warpgroups of 64
BLOCK_N = 64           # key rows per ring slot
STAGES = 3             # K/V ring: Q, dO 64 KiB + 32 KiB per slot
_BLOCK_M, _BLOCK_N = gl.constexpr(BLOCK_M), gl.constexpr(BLOCK_N)
_CONSUMER_REGS, _PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
MAXNREG = 168


@gluon.jit
def _consumer(wg: gl.constexpr, q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty,
              DQ, O, LSE2, DELTA, start, seq_len, m0, h, H, stride_t, scale, qk_scale, inv_norm,
              n_full, n_tiles, SILU: gl.constexpr):
    """Query rows [m0 + 64·wg, +64) against key tiles 0 .. n_tiles - 1."""
    WG_M: gl.constexpr = _BLOCK_M // 2
    D: gl.constexpr = k_ring.type.shape[2]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    io: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, s_layout))
    row_ok = rows < seq_len
    if not SILU:
        # delta = rowsum(dO·O) for these rows, stored for the dK/dV kernel
        io_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, io))
        io_cols = gl.arange(0, D, layout=gl.SliceLayout(0, io))
        offs = h * D + (start + io_rows)[:, None] * stride_t + io_cols[None, :]
        io_ok = (io_rows < seq_len)[:, None]
        o = gl.load(O + offs, mask=io_ok, other=0.0).to(gl.float32)
        mbarrier.wait(qdo_bar, 0)
        do = do_smem.index(wg).load(io).to(gl.float32)
        delta = gl.convert_layout(gl.sum(o * do, 1), gl.SliceLayout(1, s_layout))
        gl.store(DELTA + (start + rows) * H + h, delta, mask=row_ok)
        lse = gl.load(LSE2 + (start + rows) * H + h, mask=row_ok, other=float("inf"))
    mbarrier.wait(qdo_bar, 0)
    q_w = q_smem.index(wg)
    do_w = do_smem.index(wg)
    dq = gl.zeros([WG_M, D], gl.float32, acc_layout)
    for j in range(n_tiles):
        stage = j % STAGES
        phase = (j // STAGES) & 1
        mbarrier.wait(k_ready.index(stage), phase)
        s_tok = warpgroup_mma(q_w, k_ring.index(stage).permute((1, 0)),
                              gl.zeros([WG_M, _BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(stage), phase)
        dp_tok = warpgroup_mma(do_w, v_ring.index(stage).permute((1, 0)),
                               gl.zeros([WG_M, _BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
        keys = j * _BLOCK_N + gl.arange(0, _BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        allowed = keys[None, :] <= rows[:, None]
        if SILU:
            x = s * scale
            sg = _sigmoid_fast(x)
            grad = sg * (1.0 + x * (1.0 - sg)) * inv_norm
            if j >= n_full:
                grad = gl.where(allowed, grad, 0.0)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = dp * grad
        else:
            p = gl.exp2(s * qk_scale - lse[:, None])
            if j >= n_full:
                p = gl.where(allowed, p, 0.0)
            dp = warpgroup_mma_wait(0, deps=[dp_tok])
            ds = p * (dp - delta[:, None])
        dq_tok = warpgroup_mma(gl.convert_layout(ds.to(gl.bfloat16), op_layout), k_ring.index(stage), dq,
                               is_async=True)
        dq = warpgroup_mma_wait(0, deps=[dq_tok])
        mbarrier.arrive(empty.index(stage), count=1)
    o_rows = m0 + wg * WG_M + gl.arange(0, WG_M, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    gl.store(DQ + h * D + (start + o_rows)[:, None] * stride_t + cols[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(o_rows < seq_len)[:, None])


@gluon.jit
def _second_consumer(q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, q_desc, do_desc,
                     k_desc, v_desc, DQ, O, LSE2, DELTA, start, seq_len, m0, h, H, stride_t, scale,
                     qk_scale, inv_norm, n_full, n_tiles, SILU: gl.constexpr):
    _consumer(1, q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, DQ, O, LSE2, DELTA,
              start, seq_len, m0, h, H, stride_t, scale, qk_scale, inv_norm, n_full, n_tiles, SILU)


@gluon.jit
def _producer(q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, q_desc, do_desc,
              k_desc, v_desc, DQ, O, LSE2, DELTA, start, seq_len, m0, h, H, stride_t, scale,
              qk_scale, inv_norm, n_full, n_tiles, SILU: gl.constexpr):
    """One warp: both halves of Q and dO once, then K/V tiles into the ring."""
    D: gl.constexpr = k_ring.type.shape[2]
    STAGES: gl.constexpr = k_ring.type.shape[0]
    col = h * D
    mbarrier.expect(qdo_bar, 2 * q_desc.block_type.nbytes + 2 * do_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(q_desc, [start + m0 + half * (_BLOCK_M // 2), col], qdo_bar, q_smem.index(half))
        _tma_load(do_desc, [start + m0 + half * (_BLOCK_M // 2), col], qdo_bar, do_smem.index(half))
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
        row = start + j * _BLOCK_N
        mbarrier.expect(k_ready.index(stage), k_desc.block_type.nbytes)
        _tma_load(k_desc, [row, col], k_ready.index(stage), k_ring.index(stage))
        mbarrier.expect(v_ready.index(stage), v_desc.block_type.nbytes)
        _tma_load(v_desc, [row, col], v_ready.index(stage), v_ring.index(stage))


@gluon.jit
def _gluon_attn_bwd_dq(q_desc, do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, offsets, stride_t, H, scale,
                       qk_scale, inv_norm, STAGES: gl.constexpr, SILU: gl.constexpr):
    """Grid (B·H, cdiv(max_len, 128)), heaviest query tiles first. Descriptors over (T, H·D)
    views: q / dO in (64, D) blocks, k / v in (64, D). O (T, H, D) for delta; LSE2, DELTA (T, H)."""
    pid_bh = gl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    m0 = (gl.num_programs(1) - 1 - gl.program_id(1)) * _BLOCK_M
    start = gl.load(offsets + b).to(gl.int32)
    seq_len = gl.load(offsets + b + 1).to(gl.int32) - start
    if m0 < seq_len:
        n_full = m0 // _BLOCK_N
        n_tiles = gl.minimum(n_full + _BLOCK_M // _BLOCK_N, gl.cdiv(seq_len, _BLOCK_N))
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2] + do_desc.block_type.shape, do_desc.layout)
        k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(qdo_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_consumer, (0, q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, DQ, O, LSE2,
                         DELTA, start, seq_len, m0, h, H, stride_t, scale, qk_scale, inv_norm, n_full,
                         n_tiles, SILU)),
            (_second_consumer, (q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, q_desc,
                                do_desc, k_desc, v_desc, DQ, O, LSE2, DELTA, start, seq_len, m0, h, H,
                                stride_t, scale, qk_scale, inv_norm, n_full, n_tiles, SILU)),
            (_producer, (q_smem, do_smem, k_ring, v_ring, qdo_bar, k_ready, v_ready, empty, q_desc, do_desc,
                         k_desc, v_desc, DQ, O, LSE2, DELTA, start, seq_len, m0, h, H, stride_t, scale,
                         qk_scale, inv_norm, n_full, n_tiles, SILU)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def _descriptors(q, do, k, v):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, H, D = q.shape
    descs = []
    for x, rows in ((q, BLOCK_M // 2), (do, BLOCK_M // 2), (k, BLOCK_N), (v, BLOCK_N)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor(x, [x.shape[0], H * D], [x.stride(0), 1], [rows, D], layout))
    return descs


def dq_and_delta(q, k, v, out, do, lse2, offsets, max_len: int, activation: str):
    """(dq (T, H, D) bf16, delta (T, H) float32, softmax only) of causal jagged attention; inputs
    contiguous bf16 (T, H, 128), lse2 (T, H) float32 as gemcore's forward leaves it."""
    T, H, D = q.shape
    dq = torch.empty_like(q)
    delta = torch.empty(T, H, device=q.device, dtype=torch.float32)
    silu = activation == "silu"
    scale = 1 / math.sqrt(D) if not silu else 1.0 / D
    grid = (offsets.numel() - 1) * H, math.ceil(max_len / BLOCK_M)
    _gluon_attn_bwd_dq[grid](*_descriptors(q, do, k, v), dq, out, lse2, delta, offsets, dq.stride(0), H,
                             scale, scale * 1.4426950408889634, 1.0 / max_len, STAGES=STAGES, SILU=silu,
                             num_warps=4, maxnreg=MAXNREG)
    return dq, delta


def emulate(q, k, v, out, do, lse2, offsets, max_len: int, activation: str):
    """The kernel's schedule in PyTorch (float32, any device): the grid, n_full / n_tiles, the two
    warpgroups' rows, the diagonal masks and the update order. Returns (dq, delta)."""
    T, H, D = q.shape
    silu = activation == "silu"
    scale = 1 / math.sqrt(D) if not silu else 1.0 / D
    inv_norm = 1.0 / max_len
    dq, delta_out = torch.zeros(T, H, D), torch.zeros(T, H)
    qf, kf, vf, of, dof = (x.float() for x in (q, k, v, out, do))

    def rows_of(x, r0, n, start, h):                 # the next sequence's rows past the end, zeros past T
        idx = torch.arange(start + r0, start + r0 + n)
        t = torch.zeros(n, D)
        ok = idx < T
        t[ok] = x[idx[ok], h]
        return t

    for b in range(offsets.numel() - 1):
        start, seq_len = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        n_m = math.ceil(max_len / BLOCK_M)
        for h in range(H):
            for pid1 in range(n_m):
                m0 = (n_m - 1 - pid1) * BLOCK_M
                if not m0 < seq_len:
                    continue
                n_full = m0 // BLOCK_N
                n_tiles = min(n_full + BLOCK_M // BLOCK_N, -(-seq_len // BLOCK_N))
                for wg in range(2):
                    r0 = m0 + 64 * wg
                    rows = torch.arange(r0, r0 + 64)
                    ok = rows < seq_len
                    qt, dot = rows_of(qf, r0, 64, start, h), rows_of(dof, r0, 64, start, h)
                    if not silu:
                        delta = (rows_of(of, r0, 64, start, h) * dot).sum(1) * ok
                        delta_out[start + rows[ok], h] = delta[ok]
                        idx = (start + rows).clamp(max=T - 1)
                        lse = torch.where(ok, lse2[idx, h], torch.tensor(float("inf")))
                    acc = torch.zeros(64, D)
                    for j in range(n_tiles):
                        kt, vt = rows_of(kf, j * BLOCK_N, BLOCK_N, start, h), rows_of(vf, j * BLOCK_N, BLOCK_N, start, h)
                        s, dp = qt @ kt.T, dot @ vt.T
                        keys = j * BLOCK_N + torch.arange(BLOCK_N)
                        allowed = keys[None, :] <= rows[:, None]
                        if silu:
                            x = s * scale
                            sg = torch.sigmoid(x)
                            grad = sg * (1 + x * (1 - sg)) * inv_norm
                            if j >= n_full:
                                grad = grad * allowed
                            ds = dp * grad
                        else:
                            p = torch.exp2(s * scale * 1.4426950408889634 - lse[:, None])
                            if j >= n_full:
                                p = p * allowed
                            ds = p * (dp - delta[:, None])
                        acc = acc + ds.to(torch.bfloat16).float() @ kt
                    dq[start + rows[ok], h] = acc[ok] * scale
    return dq, delta_out


def check(run, device: str) -> int:
    """``run`` (emulate or the GPU kernel) against float64 autograd's dq, and delta against
    rowsum(dO·O), per activation."""
    failed = 0
    for activation in ("softmax", "silu"):
        q, k, v, do, offsets, max_len = problem(parity_lengths(device), device)
        out, dq_want, _, _ = reference(q, k, v, do, offsets, activation)
        lse2, delta_want = lse2_delta(q, k, out, do, offsets)
        dq, delta = run(q, k, v, out, do, lse2, offsets, max_len, activation)
        err = relative_error(dq, dq_want)
        print(f"{activation} dq: relative error {err:.2e} (bf16: expect < 2e-2)", flush=True)
        failed |= not err < 2e-2
        if activation == "softmax":
            err = relative_error(delta, delta_want)
            print(f"softmax delta: relative error {err:.2e} (expect < 1e-3)", flush=True)
            failed |= not err < 1e-3
    return int(failed)


def compile_only(silu: bool) -> None:
    from triton.runtime.jit import mangle_type

    x = torch.zeros(256, 4, HEAD_D, dtype=torch.bfloat16)
    d = _descriptors(x, x, x, x)
    sig = {"q_desc": mangle_type(d[0]), "do_desc": mangle_type(d[1]), "k_desc": mangle_type(d[2]),
           "v_desc": mangle_type(d[3]), "DQ": "*bf16", "O": "*bf16", "LSE2": "*fp32", "DELTA": "*fp32",
           "offsets": "*i64", "stride_t": "i32", "H": "i32", "scale": "fp32", "qk_scale": "fp32",
           "inv_norm": "fp32", "STAGES": "constexpr", "SILU": "constexpr"}
    aot_compile(_gluon_attn_bwd_dq, sig, {"STAGES": STAGES, "SILU": silu}, MAXNREG,
                f"{'silu' if silu else 'softmax'} dQ")


def run_on_gpu() -> int:
    """Parity, then the dQ kernel's GPU time beside gemcore's whole Triton backward."""
    failed = check(dq_and_delta, "cuda")
    if failed:
        return failed
    # the dQ kernel's 3 MMAs are 1.5x the forward's FLOPs
    time_beside_triton_backward({"gluon dQ + delta alone": (
        lambda q, k, v, out, do, lse2, delta, offsets, max_len, act:
        dq_and_delta(q, k, v, out, do, lse2, offsets, max_len, act))}, 1.5)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true")
    args = ap.parse_args()
    if args.emulate:
        return check(emulate, "cpu")
    if args.compile_only:
        for silu in (False, True):
            compile_only(silu)
        return 0
    return run_on_gpu()


if __name__ == "__main__":
    sys.exit(main())
