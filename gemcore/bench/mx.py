"""MXFP8: cast GB/s and MX GEMM TFLOP/s beside their anchors, measured in the same run.

Cast (8192 x 8192 bf16 by default): bytes moved = 2 read + 1 + 1/32 written per element for one
orientation (2 + 2 + 2/32 for both in one pass), beside the device-to-device copy (the limit for any
cast) and a plain-PyTorch cast under ``torch.compile``. GEMM (8192^3 and training
shapes): useful FLOPs 2·M·N·K, beside cuBLAS bf16 ``a @ b`` and ``torch._scaled_mm`` FP8 with
tensor-wise scales. MXLinear: forward + backward of (tokens, K -> N) beside bf16 ``nn.Linear``. Block-scaled FP8
(DeepSeek-V3's recipe) and rowwise FP8: :mod:`gemcore.bench.fp8`.
Each row's exactness is checked on the benchmark's inputs (casts bit for bit against the
reference on a slice; GEMMs against a float64 product of the dequantized operands on a slice).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from functools import partial

import torch

from gemcore.bench.timing import linear_fwd_bwd, median_ms

CAST_TILES = {
    "flat": [dict(NBLK=128, num_warps=4), dict(NBLK=64, num_warps=2), dict(NBLK=256, num_warps=8),
             dict(NBLK=512, num_warps=8)],
    "rows": [dict(BLOCK_R=16, NB=8, num_warps=8), dict(BLOCK_R=8, NB=8, num_warps=4),
             dict(BLOCK_R=32, NB=4, num_warps=8), dict(BLOCK_R=16, NB=16, num_warps=8),
             dict(BLOCK_R=4, NB=32, num_warps=4), dict(BLOCK_R=8, NB=32, num_warps=8),
             dict(BLOCK_R=64, NB=4, num_warps=8), dict(BLOCK_R=32, NB=8, num_warps=8),
             dict(BLOCK_R=16, NB=16, num_warps=8, programs_per_sm=4, STAGES=2),
             dict(BLOCK_R=16, NB=16, num_warps=8, programs_per_sm=2, STAGES=3),
             dict(BLOCK_R=8, NB=8, num_warps=4, programs_per_sm=8, STAGES=3),
             dict(BLOCK_R=8, NB=16, num_warps=4, programs_per_sm=8, STAGES=2),
             dict(BLOCK_R=16, NB=8, num_warps=8, programs_per_sm=4, STAGES=3)],
    "cols": [dict(NB=1, BLOCK_C=256, num_warps=4), dict(NB=1, BLOCK_C=256, num_warps=2),
             dict(NB=2, BLOCK_C=128, num_warps=2), dict(NB=1, BLOCK_C=256, num_warps=1),
             dict(NB=2, BLOCK_C=256, num_warps=2), dict(NB=1, BLOCK_C=512, num_warps=2),
             dict(NB=4, BLOCK_C=64, num_warps=2), dict(NB=2, BLOCK_C=256, num_warps=4),
             dict(NB=4, BLOCK_C=128, num_warps=4), dict(NB=1, BLOCK_C=128, num_warps=1),
             dict(NB=1, BLOCK_C=64, num_warps=1), dict(NB=2, BLOCK_C=64, num_warps=1),
             dict(NB=2, BLOCK_C=128, num_warps=1), dict(NB=1, BLOCK_C=32, num_warps=1)],
    "both": [dict(NBR=1, NBC=2, num_warps=1), dict(NBR=1, NBC=4, num_warps=1), dict(NBR=1, NBC=4, num_warps=2),
             dict(NBR=2, NBC=2, num_warps=2), dict(NBR=2, NBC=1, num_warps=1), dict(NBR=1, NBC=2, num_warps=4)],
}
TRAINING_SHAPES = [(16384, 4096, 4096), (16384, 8192, 8192)]


@dataclass
class Row:
    group: str
    name: str
    ms: float
    rate: float  # GB/s for casts, TFLOP/s for GEMMs, x-speed-up for MXLinear
    unit: str
    vs_anchor: float | None = None
    exact: bool | None = None
    note: str = ""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--size", type=int, default=8192, help="cast: SIZE x SIZE bf16; GEMM: SIZE^3")
    p.add_argument("--sweep", action="store_true", help="try every cast tile in CAST_TILES")
    p.add_argument("--skip", default="", help="comma list of parts to skip: cast,gemm,shapes,linear,fp8")
    p.add_argument("--host-launch", action="store_true",
                   help="cast: time each call with the host's launch included (default: GPU time alone)")


def _plain_cast(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch MX cast of the anchor (floor rule, e4m3, rows; not bit-exact at edges)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1)
    e = (torch.floor(torch.log2(amax)) - 8).clamp(-127, 127)
    data = (blocks * torch.exp2(-e).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return data.reshape(x.shape), (e + 127).to(torch.uint8)


def _cast_exact(got, x, elem, scale_rule, axis) -> bool:
    from gemcore.kernels.mx_reference import quantize_mx_reference

    n = 256  # a slice: rows (or columns) [0, 256)
    data, scale = got
    xs = x[:n] if axis == 1 else x[:, :n]
    d, s = quantize_mx_reference(xs, elem, 32, axis, scale_rule)
    gd, gs = (data[:n], scale[:n]) if axis == 1 else (data[:, :n], scale[:, :n])
    return torch.equal(gs, s) and torch.equal(gd.view(torch.uint8), d.view(torch.uint8))


def bench_cast(size: int, sweep: bool, launch_hidden: bool = True) -> list[Row]:
    """Cast GB/s beside the copy and the torch.compile cast, all timed the same way: GPU time
    alone (``launch_hidden``, the default: these kernels last tens of microseconds, about what the
    host spends launching them from Python) or per-call events that include the host's launch."""
    from gemcore.kernels import mx_triton as T

    def timed(fn):
        return median_ms(fn, launch_hidden=launch_hidden)

    x = torch.randn(size, size, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    one, both = n * (2 + 1 + 1 / 32), n * (2 + 2 + 2 / 32)
    rows = []
    dst = torch.empty_like(x)
    copy_ms = timed(lambda: dst.copy_(x))
    copy_gbs = 2 * x.numel() * 2 / copy_ms / 1e6
    rows.append(Row("cast", "device-to-device copy (limit)", copy_ms, copy_gbs, "GB/s"))
    rows.append(Row("cast", "plain PyTorch, eager", timed(lambda: _plain_cast(x)), 0, "GB/s"))
    try:
        compiled = torch.compile(_plain_cast)
        rows.append(Row("cast", "plain PyTorch, torch.compile (anchor)", timed(lambda: compiled(x)), 0, "GB/s"))
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        rows.append(Row("cast", "plain PyTorch, torch.compile (anchor)", float("nan"), 0, "GB/s",
                        note=f"failed: {type(exc).__name__}"))
    for r in rows[1:]:
        r.rate = one / r.ms / 1e6
    anchor = rows[-1].rate
    variants = [("flat", 1), ("rows", 1), ("cols", 0)]
    for kind, axis in variants:
        default = getattr(T, f"{kind.upper()}_TILE")
        tiles = CAST_TILES[kind] if sweep else [default]
        for soft, tile in [(False, t) for t in tiles] + [(True, default)]:
            fn = lambda: T.quantize_mx_triton(x, "e4m3", 32, axis, "rceil", soft_round=soft, tile=tile)
            try:
                exact = _cast_exact(fn(), x, "e4m3", "rceil", axis)
                ms = timed(fn)
            except Exception as exc:  # noqa: BLE001
                rows.append(Row("cast", f"triton {kind} {tile}", float("nan"), 0, "GB/s", note=repr(exc)[:80]))
                continue
            rows.append(Row("cast", f"triton {kind} ({'soft' if soft else 'hw'} round) {tile}", ms,
                            one / ms / 1e6, "GB/s", one / ms / 1e6 / anchor, exact))
    for tile in CAST_TILES["both"] if sweep else [T.BOTH_TILE]:
        fn = lambda: T.quantize_mx_both_triton(x, "e4m3", "rceil", soft_round=False, tile=tile)
        try:
            (rd, rs), (cd, cs) = fn()
            exact = _cast_exact((rd, rs), x, "e4m3", "rceil", 1) and _cast_exact((cd, cs), x, "e4m3", "rceil", 0)
            ms = timed(fn)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row("cast", f"triton both {tile}", float("nan"), 0, "GB/s", note=repr(exc)[:80]))
            continue
        rows.append(Row("cast", f"triton both orientations, one pass {tile}", ms, both / ms / 1e6, "GB/s",
                        both / ms / 1e6 / anchor, exact, note=f"= {2 * one / ms / 1e6:.0f} GB/s of two casts"))
    return rows


def _gemm_exact(out: torch.Tensor, want: torch.Tensor) -> bool:
    """Relative (Frobenius) error <= 1e-4 on the first rows, against float64."""
    got = out[:want.shape[0]].double()
    return bool((got - want).norm() / want.norm() <= 1e-4)


def bench_gemm(M: int, K: int, N: int, backends=("triton_scaled", "dequant_mm")) -> list[Row]:
    from gemcore.kernels import mx

    group = f"gemm {M}x{K}x{N}"
    flops = 2.0 * M * N * K
    a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)  # weights (N, K): b = w.t()
    b16 = w16.t()
    rows = [Row(group, "cuBLAS bf16 a @ b (anchor)", median_ms(lambda: a16 @ b16), 0, "TFLOP/s")]
    a8, w8 = a16.to(torch.float8_e4m3fn), w16.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    try:
        ms = median_ms(lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        rows.append(Row(group, "torch._scaled_mm fp8, tensor-wise scale (ceiling)", ms, 0, "TFLOP/s"))
    except Exception as exc:  # noqa: BLE001
        rows.append(Row(group, "torch._scaled_mm fp8", float("nan"), 0, "TFLOP/s", note=repr(exc)[:80]))
    for r in rows:
        r.rate = flops / r.ms / 1e9
    anchor = rows[0].rate
    a = mx.quantize_mx(a16, axis=-1, scale_rule="rceil")
    b = mx.quantize_mx(w16, axis=-1, scale_rule="rceil").t()
    a_rows = mx.MXTensor(a.data[:128], a.scale[:128], a.elem, a.block, a.axis, a.scale_rule)
    want = a_rows.dequantize(torch.float64) @ b.dequantize(torch.float64)
    for backend in backends:
        fn = partial(mx.mx_matmul, a, b, out_dtype=torch.bfloat16, backend=backend)
        fn32 = partial(mx.mx_matmul, a, b, out_dtype=torch.float32, backend=backend)
        try:
            exact = _gemm_exact(fn32(), want)
            ms = median_ms(fn)
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(group, f"mx {backend}", float("nan"), 0, "TFLOP/s", note=repr(exc)[:100]))
            continue
        rate = flops / ms / 1e9
        rows.append(Row(group, f"mx {backend}", ms, rate, "TFLOP/s", rate / anchor, exact))
    return rows


def bench_linear(tokens: int, K: int, N: int) -> list[Row]:
    from torch import nn

    from gemcore.kernels import mx

    group = f"linear fwd+bwd {tokens}x{K}->{N}"
    lin = nn.Linear(K, N, device="cuda")
    mxl = mx.MXLinear.from_linear(lin)
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)

    def step(module):
        return linear_fwd_bwd(module, x, dy)

    flops = 6.0 * tokens * K * N
    base = median_ms(step(lin))
    rows = [Row(group, "nn.Linear bf16 autocast (anchor)", base, flops / base / 1e9, "TFLOP/s")]
    try:
        ms = median_ms(step(mxl))
        rows.append(Row(group, "MXLinear (casts + 3 MX GEMMs)", ms, flops / ms / 1e9, "TFLOP/s", base / ms))
    except Exception as exc:  # noqa: BLE001
        rows.append(Row(group, "MXLinear", float("nan"), 0, "TFLOP/s", note=repr(exc)[:100]))
    return rows


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("gem bench mx: needs a CUDA GPU (the cast and GEMM kernels are Triton)")
        return 2
    skip = {s for s in args.skip.split(",") if s}
    rows: list[Row] = []
    device = torch.cuda.get_device_name()
    if "cast" not in skip:
        rows += bench_cast(args.size, args.sweep, launch_hidden=not args.host_launch)
    if "gemm" not in skip:
        rows += bench_gemm(args.size, args.size, args.size)
    if "shapes" not in skip:
        for M, K, N in TRAINING_SHAPES:
            rows += bench_gemm(M, K, N, backends=("dequant_mm",))
    if "linear" not in skip:
        rows += bench_linear(16384, 8192, 8192)
    if "fp8" not in skip:
        from gemcore.bench.fp8 import fp8_rows

        rows += fp8_rows()
    if args.json:
        print(json.dumps({"device": device, "torch": torch.__version__, "rows": [asdict(r) for r in rows]}, indent=1))
        return 0
    print(f"gem bench mx on {device} (torch {torch.__version__}); cast timing: "
          f"{'host launch included' if args.host_launch else 'GPU time alone (launch hidden behind a spacer kernel)'}")
    group = None
    for r in rows:
        if r.group != group:
            group = r.group
            print(f"\n{group}")
        vs = f"{r.vs_anchor:5.2f}x" if r.vs_anchor is not None else "      "
        ok = {True: "exact", False: "WRONG", None: ""}[r.exact]
        print(f"  {r.name:<72} {r.ms:8.3f} ms {r.rate:8.0f} {r.unit:<7} {vs} {ok:5} {r.note}")
    return 0
