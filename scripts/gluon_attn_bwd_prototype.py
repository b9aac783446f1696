"""Prototype, NOT part of gemcore and never run on a GPU: the dK/dV kernel of the jagged attention
backward in Gluon for Hopper, with the structure of gemcore's Gluon forward
(``kernels/jagged_attention_gluon.py``): a TMA producer warp and two consumer warpgroups.

dK/dV is most of the backward's time (session 14's Nsight Compute: 6.99 of 10.5 ms for softmax on
dense95) and the backward is most of forward+backward. This kernel would replace the Triton dK/dV
kernel only; the Triton dQ kernel stays (it also writes softmax's ``delta = rowsum(dO·O)``).

One CTA per (sequence, head, 128 key rows); each consumer warpgroup owns 64 key rows and keeps
their dK and dV accumulators (64 x D fp32 each) in registers. The producer loads both K/V halves
once, then the query tiles that see them (64 rows of Q and dO per ring slot) through TMA. Per query
tile and warpgroup, with the scores transposed (keys x queries), five wgmmas:
  Sᵀ = K Qᵀ and dPᵀ = V dOᵀ go out together; Pᵀ = exp2(Sᵀ·scale·log2 e − lse) (softmax) or
  act(scale·Sᵀ)/norm; dV += Pᵀ dO goes out while dSᵀ = Pᵀ ⊙ (dPᵀ − delta) (or dPᵀ ⊙ act'/norm)
  is computed; dK += dSᵀ Q; at the end dK ·= scale.
Scope: bf16, D = 128, causal self-attention, softmax or silu, no targets or window.

    python scripts/gluon_attn_bwd_prototype.py --emulate        # the schedule in PyTorch, on a CPU
    python scripts/gluon_attn_bwd_prototype.py --compile-only   # AOT for sm_90: registers, spills
    python scripts/gluon_attn_bwd_prototype.py                  # on an H100/H200: parity + timing
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

from gluon_bwd_harness import (HEAD_D, aot_compile, lse2_delta, parity_lengths, problem, reference,  # beside this
                               relative_error, time_beside_triton_backward)


BLOCK_N = 128          # key rows per CTA: two consumer warpgroups of 64
BLOCK_M = 64           # query rows per ring slot
STAGES = 2             # Q / dO ring slots: K, V 64 KiB + 32 KiB per slot (the GPU run also times 3)
_BLOCK_N, _BLOCK_M = gl.constexpr(BLOCK_N), gl.constexpr(BLOCK_M)
_CONSUMER_REGS, _PRODUCER_REGS = gl.constexpr(240), gl.constexpr(24)
MAXNREG = 168


@gluon.jit
def _sigmoid_fast(x):
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return 0.5 + 0.5 * t


@gluon.jit
def _consumer(wg: gl.constexpr, k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty,
              DK, DV, LSE2, DELTA, start, seq_len, n0, h, H, stride_t, scale, qk_scale, inv_norm,
              i0, n_iters, SILU: gl.constexpr):
    """Key rows [n0 + 64·wg, n0 + 64·wg + 64) against query tiles i0 .. i0 + n_iters - 1."""
    WG_N: gl.constexpr = _BLOCK_N // 2
    D: gl.constexpr = k_smem.type.shape[2]
    STAGES: gl.constexpr = q_ring.type.shape[0]
    st_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, _BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    k_w = k_smem.index(wg)
    v_w = v_smem.index(wg)
    keys = n0 + wg * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, st_layout))
    dk = gl.zeros([WG_N, D], gl.float32, acc_layout)
    dv = gl.zeros([WG_N, D], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)
    for it in range(n_iters):
        m0 = (i0 + it) * _BLOCK_M
        stage = it % STAGES
        phase = (it // STAGES) & 1
        queries = m0 + gl.arange(0, _BLOCK_M, layout=gl.SliceLayout(0, st_layout))
        q_ok = queries < seq_len
        if not SILU:
            lse = gl.load(LSE2 + (start + queries) * H + h, mask=q_ok, other=float("inf"))
            delta = gl.load(DELTA + (start + queries) * H + h, mask=q_ok, other=0.0)
        mbarrier.wait(q_ready.index(stage), phase)
        st_tok = warpgroup_mma(k_w, q_ring.index(stage).permute((1, 0)),
                               gl.zeros([WG_N, _BLOCK_M], gl.float32, st_layout), use_acc=False,
                               is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dpt_tok = warpgroup_mma(v_w, do_ring.index(stage).permute((1, 0)),
                                gl.zeros([WG_N, _BLOCK_M], gl.float32, st_layout), use_acc=False,
                                is_async=True)
        st = warpgroup_mma_wait(1, deps=[st_tok])
        # the diagonal's and the sequence's last query tiles are masked (key <= query < seq_len)
        masked = (m0 < n0 + wg * WG_N + WG_N) | (m0 + _BLOCK_M > seq_len)
        allowed = (keys[:, None] <= queries[None, :]) & q_ok[None, :]
        if SILU:
            x = st * scale
            sg = _sigmoid_fast(x)
            pt = x * sg * inv_norm
            grad = sg * (1.0 + x * (1.0 - sg)) * inv_norm
            if masked:
                pt = gl.where(allowed, pt, 0.0)
                grad = gl.where(allowed, grad, 0.0)
        else:
            pt = gl.exp2(st * qk_scale - lse[None, :])
            if masked:
                pt = gl.where(allowed, pt, 0.0)
        dv_tok = warpgroup_mma(gl.convert_layout(pt.to(gl.bfloat16), op_layout), do_ring.index(stage), dv,
                               is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        if SILU:
            dst = dpt * grad
        else:
            dst = pt * (dpt - delta[None, :])
        dk_tok = warpgroup_mma(gl.convert_layout(dst.to(gl.bfloat16), op_layout), q_ring.index(stage), dk,
                               is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=[dv_tok, dk_tok])
        mbarrier.arrive(empty.index(stage), count=1)
    rows = n0 + wg * WG_N + gl.arange(0, WG_N, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = h * D + (start + rows)[:, None] * stride_t + cols[None, :]
    ok = (rows < seq_len)[:, None]
    gl.store(DK + offs, (dk * scale).to(DK.dtype.element_ty), mask=ok)
    gl.store(DV + offs, dv.to(DV.dtype.element_ty), mask=ok)


@gluon.jit
def _second_consumer(k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, k_desc, v_desc,
                     q_desc, do_desc, DK, DV, LSE2, DELTA, start, seq_len, n0, h, H, stride_t, scale,
                     qk_scale, inv_norm, i0, n_iters, SILU: gl.constexpr):
    _consumer(1, k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, DK, DV, LSE2, DELTA,
              start, seq_len, n0, h, H, stride_t, scale, qk_scale, inv_norm, i0, n_iters, SILU)


@gluon.jit
def _producer(k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, k_desc, v_desc,
              q_desc, do_desc, DK, DV, LSE2, DELTA, start, seq_len, n0, h, H, stride_t, scale,
              qk_scale, inv_norm, i0, n_iters, SILU: gl.constexpr):
    """One warp: both K/V halves once, then Q and dO tiles into the ring."""
    D: gl.constexpr = k_smem.type.shape[2]
    STAGES: gl.constexpr = q_ring.type.shape[0]
    col = h * D
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes + 2 * v_desc.block_type.nbytes)
    for half in gl.static_range(2):
        _tma_load(k_desc, [start + n0 + half * (_BLOCK_N // 2), col], kv_bar, k_smem.index(half))
        _tma_load(v_desc, [start + n0 + half * (_BLOCK_N // 2), col], kv_bar, v_smem.index(half))
    for it in range(n_iters):
        stage = it % STAGES
        mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)
        row = start + (i0 + it) * _BLOCK_M
        mbarrier.expect(q_ready.index(stage), q_desc.block_type.nbytes)
        _tma_load(q_desc, [row, col], q_ready.index(stage), q_ring.index(stage))
        mbarrier.expect(do_ready.index(stage), do_desc.block_type.nbytes)
        _tma_load(do_desc, [row, col], do_ready.index(stage), do_ring.index(stage))


@gluon.jit
def _gluon_attn_bwd_dkdv(k_desc, v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, offsets, stride_t, H,
                         scale, qk_scale, inv_norm, STAGES: gl.constexpr, SILU: gl.constexpr):
    """Grid (B·H, cdiv(max_len, 128)), the key tiles seen by the most queries (a sequence's first)
    first. k/v descriptors in (64, D) blocks, q/dO in (BLOCK_M, D) blocks, over (T, H·D) views."""
    pid_bh = gl.program_id(0)
    b = pid_bh // H
    h = pid_bh % H
    n0 = gl.program_id(1) * _BLOCK_N
    start = gl.load(offsets + b).to(gl.int32)
    seq_len = gl.load(offsets + b + 1).to(gl.int32) - start
    if n0 < seq_len:
        i0 = n0 // _BLOCK_M                        # causal: queries from the key tile's first row on
        n_iters = gl.cdiv(seq_len, _BLOCK_M) - i0
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2] + v_desc.block_type.shape, v_desc.layout)
        q_ring = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_ring = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize([
            (_consumer, (0, k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, DK, DV, LSE2,
                         DELTA, start, seq_len, n0, h, H, stride_t, scale, qk_scale, inv_norm, i0, n_iters,
                         SILU)),
            (_second_consumer, (k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, k_desc,
                                v_desc, q_desc, do_desc, DK, DV, LSE2, DELTA, start, seq_len, n0, h, H,
                                stride_t, scale, qk_scale, inv_norm, i0, n_iters, SILU)),
            (_producer, (k_smem, v_smem, q_ring, do_ring, kv_bar, q_ready, do_ready, empty, k_desc, v_desc,
                         q_desc, do_desc, DK, DV, LSE2, DELTA, start, seq_len, n0, h, H, stride_t, scale,
                         qk_scale, inv_norm, i0, n_iters, SILU)),
        ], [4, 1], [_CONSUMER_REGS, _PRODUCER_REGS])


def _descriptors(k, v, q, do):
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    T, H, D = q.shape
    descs = []
    for x, rows in ((k, BLOCK_N // 2), (v, BLOCK_N // 2), (q, BLOCK_M), (do, BLOCK_M)):
        layout = gl.NVMMASharedLayout.get_default_for([rows, D], gl.bfloat16)
        descs.append(TensorDescriptor(x, [x.shape[0], H * D], [x.stride(0), 1], [rows, D], layout))
    return descs


def dkdv(q, k, v, do, lse2, delta, offsets, max_len: int, activation: str, stages: int = STAGES):
    """(dk, dv) of causal jagged attention; q, k, v, do contiguous bf16 (T, H, 128); lse2 and
    delta (T, H) float32 as gemcore's forward and dQ kernel leave them (softmax only)."""
    T, H, D = q.shape
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    silu = activation == "silu"
    scale = 1 / math.sqrt(D) if not silu else 1.0 / D
    grid = (offsets.numel() - 1) * H, math.ceil(max_len / BLOCK_N)
    _gluon_attn_bwd_dkdv[grid](*_descriptors(k, v, q, do), dk, dv, lse2, delta, offsets, dk.stride(0), H,
                               scale, scale * 1.4426950408889634, 1.0 / max_len, STAGES=stages, SILU=silu,
                               num_warps=4, maxnreg=MAXNREG)
    return dk, dv


def emulate(q, k, v, do, lse2, delta, offsets, max_len: int, activation: str):
    """The kernel's schedule in PyTorch (float32 on any device): the grid, i0 / n_iters, the two
    warpgroups' key rows, the masked-tile rule and the update order, so index mistakes show on a
    CPU. Not Gluon semantics: layouts, barriers and async completion are the GPU run's to check."""
    T, H, D = q.shape
    silu = activation == "silu"
    scale = 1 / math.sqrt(D) if not silu else 1.0 / D
    inv_norm = 1.0 / max_len
    dk, dv = torch.zeros(T, H, D), torch.zeros(T, H, D)
    qf, kf, vf, dof = (x.float() for x in (q, k, v, do))

    def rows_of(x, r0, n, seq_len, start, h):            # zero past T, next sequence's rows past seq_len
        idx = torch.arange(start + r0, start + r0 + n)
        out = torch.zeros(n, D)
        ok = idx < T
        out[ok] = x[idx[ok], h]
        return out

    for b in range(offsets.numel() - 1):
        start, seq_len = int(offsets[b]), int(offsets[b + 1] - offsets[b])
        for h in range(H):
            for pid1 in range(math.ceil(max_len / BLOCK_N)):
                n0 = pid1 * BLOCK_N
                if not n0 < seq_len:
                    continue
                i0 = n0 // BLOCK_M
                n_iters = -(-seq_len // BLOCK_M) - i0
                for wg in range(2):
                    kw0 = n0 + wg * (BLOCK_N // 2)
                    kt, vt = (rows_of(x, n0 + wg * 64, 64, seq_len, start, h) for x in (kf, vf))
                    keys = torch.arange(kw0, kw0 + 64)
                    dkw, dvw = torch.zeros(64, D), torch.zeros(64, D)
                    for it in range(n_iters):
                        m0 = (i0 + it) * BLOCK_M
                        queries = torch.arange(m0, m0 + BLOCK_M)
                        q_ok = queries < seq_len
                        qt, dot = (rows_of(x, m0, BLOCK_M, seq_len, start, h) for x in (qf, dof))
                        st, dpt = kt @ qt.T, vt @ dot.T
                        masked = m0 < kw0 + 64 or m0 + BLOCK_M > seq_len
                        allowed = (keys[:, None] <= queries[None, :]) & q_ok[None, :]
                        if silu:
                            x = st * scale
                            sg = torch.sigmoid(x)
                            pt = x * sg * inv_norm
                            grad = sg * (1 + x * (1 - sg)) * inv_norm
                            if masked:
                                pt, grad = pt * allowed, grad * allowed
                            dst = dpt * grad
                        else:
                            idx = (start + queries).clamp(max=T - 1)
                            lse = torch.where(q_ok, lse2[idx, h], torch.tensor(float("inf")))
                            dlt = torch.where(q_ok, delta[idx, h], torch.tensor(0.0))
                            pt = torch.exp2(st * scale * 1.4426950408889634 - lse[None, :])
                            if masked:
                                pt = pt * allowed
                            dst = pt * (dpt - dlt[None, :])
                        dvw += pt.to(torch.bfloat16).float() @ dot
                        dkw += dst.to(torch.bfloat16).float() @ qt
                    ok = keys < seq_len
                    dk[start + keys[ok], h] = dkw[ok] * scale
                    dv[start + keys[ok], h] = dvw[ok]
    return dk, dv


def check(run, device: str) -> int:
    """``run`` (emulate or the GPU kernel) against float64 autograd, per activation."""
    failed = 0
    for activation in ("softmax", "silu"):
        q, k, v, do, offsets, max_len = problem(parity_lengths(device), device)
        out, _, dk_want, dv_want = reference(q, k, v, do, offsets, activation)
        lse2, delta = lse2_delta(q, k, out, do, offsets)
        dk, dv = run(q, k, v, do, lse2, delta, offsets, max_len, activation)
        for name, got, want in (("dk", dk, dk_want), ("dv", dv, dv_want)):
            err = relative_error(got, want)
            print(f"{activation} {name}: relative error {err:.2e} (bf16: expect < 2e-2)", flush=True)
            failed |= not err < 2e-2
    return int(failed)


def compile_only(silu: bool) -> None:
    from triton.runtime.jit import mangle_type

    x = torch.zeros(256, 4, HEAD_D, dtype=torch.bfloat16)
    descs = _descriptors(x, x, x, x)
    sig = {"k_desc": mangle_type(descs[0]), "v_desc": mangle_type(descs[1]), "q_desc": mangle_type(descs[2]),
           "do_desc": mangle_type(descs[3]), "DK": "*bf16", "DV": "*bf16", "LSE2": "*fp32", "DELTA": "*fp32",
           "offsets": "*i64", "stride_t": "i32", "H": "i32", "scale": "fp32", "qk_scale": "fp32",
           "inv_norm": "fp32", "STAGES": "constexpr", "SILU": "constexpr"}
    aot_compile(_gluon_attn_bwd_dkdv, sig, {"STAGES": STAGES, "SILU": silu}, MAXNREG,
                f"{'silu' if silu else 'softmax'} dK/dV")


def run_on_gpu() -> int:
    """Parity against float64 autograd, then dK/dV's GPU time (2 and 3 ring slots) beside
    gemcore's whole Triton backward in the same process."""
    failed = check(dkdv, "cuda")
    if failed:
        return failed
    # the dK/dV kernel's 4 MMAs are 2x the forward's FLOPs
    time_beside_triton_backward({f"gluon dK/dV alone, {stages} slots": (
        lambda q, k, v, out, do, lse2, delta, offsets, max_len, act, stages=stages:
        dkdv(q, k, v, do, lse2, delta, offsets, max_len, act, stages)) for stages in (2, 3)}, 2.0)
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
