"""Block-scaled FP8 rows of ``gem bench mx``: GEMMs, linear forward+backward and casts beside
their anchors, each timed twice in the same run: GPU time alone (the host's launch work hidden
behind a spacer kernel) and host included (each call from an idle GPU, as a caller meets it).

* GEMM ``a @ w^T`` (useful FLOPs 2·M·N·K): cuBLAS bf16 (anchor), ``torch._scaled_mm`` FP8 with one
  tensor-wise scale (the FP8 ceiling), rowwise FP8 (per-row scales, torchao's float8 recipe),
  and ``fp8_block`` (1x128 activations times 128x128 weights) through each backend. The fast
  paths' relative Frobenius error against float64 of the dequantized operands is checked on the
  first 128 rows (bound 1e-3).
* Linear forward+backward (6·tokens·K·N FLOPs): ``nn.Linear`` under bf16 autocast (anchor),
  a rowwise FP8 linear (all three GEMMs rowwise, casts in eager PyTorch) and ``FP8BlockLinear``
  (casts included).
* Casts of a bf16 (tokens, K) activation and a (N, K) weight, GB/s (1e9 bytes a second) = bytes
  read + written (2 read, 1 written per element and layout, plus 4 bytes a block's scale), each
  checked bit for bit against the reference on its first 256 rows, beside the
  device-to-device copy (the limit) and ``torch.compile`` of a plain-PyTorch 1x128 cast, rows alone
  (the rows cast's anchor) and rows + transposed columns (the two-layout cast's anchor: the same
  work), and of torchao's ``to_mx`` where torchao is installed.
"""
from __future__ import annotations

import importlib.util

import torch

from gemcore.bench.mx import Row
from gemcore.bench.timing import linear_fwd_bwd, median_ms

SQUARE = 8192
BLOCK_ROWS = 128  # the weights' blocks are 128x128
#: (tokens, K, N) of the GEM model's projections (hidden 1024, MLP 4096): qkv, out, MLP up and down
MODEL_SHAPES = [(24576, 1024, 3072), (24576, 1024, 1024), (24576, 1024, 4096), (24576, 4096, 1024)]
LINEAR_SHAPES = [(24576, 1024, 3072), (24576, 4096, 1024), (8192, 8192, 8192)]
BOUND = 1e-3
#: other tiles of the Triton GEMM timed at 8192^3 (the default is MM_TILE)
TRITON_TILES = [dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=3),
                dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=4, num_stages=4),
                dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=5)]


def _times(fn) -> tuple[float, float]:
    """(GPU-only ms, host-included ms)."""
    return median_ms(fn, launch_hidden=True), median_ms(fn, launch_hidden=False)


#: work per millisecond -> the unit: bytes/ms / 1e6 = GB/s (1e9 B/s), FLOPs/ms / 1e9 = TFLOP/s
PER_MS = {"GB/s": 1e6, "TFLOP/s": 1e9}


def rate(work: float, ms: float, unit: str) -> float:
    """``work`` (bytes for GB/s, FLOPs for TFLOP/s) done in ``ms`` milliseconds, in ``unit``."""
    if unit not in PER_MS:
        raise ValueError(f"unit must be one of {tuple(PER_MS)}, got {unit!r}")
    return work / ms / PER_MS[unit]


def _row(group, name, fn, work, unit, anchor=None, note="", check=None) -> Row:
    """Time ``fn`` both ways; ``check()`` (run first) returns a note on the result's accuracy."""
    try:
        if check is not None:
            note = check()
        gpu_ms, host_ms = _times(fn)
    except Exception as exc:  # noqa: BLE001 - report, keep benchmarking
        return Row(group, name, float("nan"), 0.0, unit, note=f"failed: {repr(exc)[:120]}")
    gpu_rate = rate(work, gpu_ms, unit)
    return Row(group, name, gpu_ms, gpu_rate, unit, gpu_rate / anchor if anchor else None,
               note=f"host incl. {host_ms:.3f} ms = {rate(work, host_ms, unit):.0f} {unit}"
               + (f"; {note}" if note else ""))


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got[:want.shape[0]].double()
    return float((got - want).norm() / want.norm())


def _rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row FP8 (torchao's float8 rowwise recipe): (e4m3 data, float32 (R, 1) decode scales)."""
    amax = x.abs().amax(dim=1, keepdim=True).float().clamp_min(1e-12)
    scale = amax / 448.0
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _rowwise_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a (M, K) @ b (N, K)^T with both cast per row (along K) to FP8, through torch._scaled_mm."""
    (a8, sa), (b8, sb) = _rowwise(a), _rowwise(b)
    return torch._scaled_mm(a8, b8.t(), scale_a=sa, scale_b=sb.t(), out_dtype=out_dtype)


class _RowwiseFP8Linear(torch.autograd.Function):
    """y = x Wᵀ with all three GEMMs in rowwise FP8 (torchao's float8 "rowwise" recipe: each
    operand scaled per row along its GEMM's K). The reference row of the benchmark."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _rowwise_mm(x, weight.to(x.dtype), x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy = dy.contiguous()
        dx = _rowwise_mm(dy, weight.to(dy.dtype).t().contiguous(), x.dtype)
        dw = _rowwise_mm(dy.t().contiguous(), x.t().contiguous(), torch.float32)
        return dx, dw.to(weight.dtype)


class RowwiseFP8Linear(torch.nn.Linear):
    """``nn.Linear`` through :class:`_RowwiseFP8Linear` (bf16 in, bf16 out), for the benchmark."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(x.device.type, enabled=False):
            y = _RowwiseFP8Linear.apply(x.reshape(-1, self.in_features).to(torch.bfloat16), self.weight)
            return y.reshape(*x.shape[:-1], self.out_features) + self.bias.to(y.dtype)


def bench_gemm(M: int, K: int, N: int, tiles: list[dict] = ()) -> list[Row]:
    from gemcore.kernels import fp8_block as fb

    group = f"fp8 gemm {M}x{K}x{N}"
    flops = 2.0 * M * N * K
    a16 = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w16 = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    rows = [_row(group, "cuBLAS bf16 a @ w.t() (anchor)", lambda: a16 @ w16.t(), flops, "TFLOP/s")]
    anchor = rows[0].rate or None
    a8, w8 = a16.to(torch.float8_e4m3fn), w16.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    rows.append(_row(group, "torch._scaled_mm fp8, tensor-wise scale (ceiling)",
                     lambda: torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                     flops, "TFLOP/s", anchor))
    (ar, sa), (wr, sw) = _rowwise(a16), _rowwise(w16)
    rows.append(_row(group, "rowwise fp8 torch._scaled_mm (torchao float8 recipe)",
                     lambda: torch._scaled_mm(ar, wr.t(), scale_a=sa, scale_b=sw.t(), out_dtype=torch.bfloat16),
                     flops, "TFLOP/s", anchor))
    a = fb.quantize_rows(a16)
    w, _ = fb.quantize_weight(w16, transpose=False)
    a_head = fb.BlockFP8(a.data[:128], fb._col_major(a.scale[:128]), 1)
    want = a_head.dequantize(torch.float64) @ w.dequantize(torch.float64).t()
    for backend in ("cublas", "scaled_mm", "triton"):
        def check(backend=backend) -> str:
            err = _rel_err(fb.fp8_block_mm(a, w, torch.float32, backend=backend), want)
            return f"rel err {err:.1e} {'<=' if err <= BOUND else 'ABOVE'} {BOUND:g}"

        rows.append(_row(group, f"fp8_block {backend} (1x128 x 128x128)",
                         lambda backend=backend: fb.fp8_block_mm(a, w, torch.bfloat16, backend=backend),
                         flops, "TFLOP/s", anchor, check=check))
    from gemcore.kernels.fp8_block_triton import fp8_block_mm_triton

    for tile in tiles:
        def run(out_dtype, tile=tile):
            return fp8_block_mm_triton(a.data, a.scale, w.data, w.scale, BLOCK_ROWS, out_dtype, tile=tile)

        rows.append(_row(group, f"fp8_block triton {tile}", lambda run=run: run(torch.bfloat16), flops,
                         "TFLOP/s", anchor, check=lambda run=run: f"rel err {_rel_err(run(torch.float32), want):.1e}"))
    return rows


def bench_linear(tokens: int, K: int, N: int) -> list[Row]:
    from torch import nn

    from gemcore.kernels import fp8_block as fb

    group = f"fp8 linear fwd+bwd {tokens}x{K}->{N}"
    lin = nn.Linear(K, N, device="cuda")
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(tokens, N, device="cuda", dtype=torch.bfloat16)

    def step(module):
        return linear_fwd_bwd(module, x, dy)

    flops = 6.0 * tokens * K * N
    rows = [_row(group, "nn.Linear bf16 autocast (anchor)", step(lin), flops, "TFLOP/s")]
    rowwise = RowwiseFP8Linear(K, N, device="cuda")
    rowwise.load_state_dict(lin.state_dict())
    rows.append(_row(group, "rowwise fp8 linear (torchao float8 recipe, eager casts)", step(rowwise), flops,
                     "TFLOP/s", rows[0].rate or None))
    for backend in ("cublas", "scaled_mm", "triton"):
        rows.append(_row(group, f"FP8BlockLinear {backend} (casts + 3 GEMMs)",
                         step(fb.FP8BlockLinear.from_linear(lin, matmul=backend)), flops, "TFLOP/s",
                         rows[0].rate or None))
    return rows


def _plain_block_cast(x: torch.Tensor):
    """A plain-PyTorch 1x128 cast with power-of-two scales (the torch.compile anchor)."""
    blocks = x.float().reshape(x.shape[0], -1, 128)
    amax = blocks.abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(2.0**-126) / 448.0)))
    return (blocks / scale).to(torch.float8_e4m3fn).reshape(x.shape), scale


def _plain_block_cast_both(x: torch.Tensor):
    """The same plain-PyTorch cast of x (M, K) along both axes: 1x128 rows and the transposed 128x1
    columns (the work of ``fp8_block.quantize_act``), the torch.compile anchor of the two-layout cast."""
    return _plain_block_cast(x), _plain_block_cast(x.t())


def bench_cast(tokens: int, K: int) -> list[Row]:
    from gemcore.kernels import fp8_block as fb

    group = f"fp8 cast bf16 {tokens}x{K}"
    x = torch.randn(tokens, K, device="cuda", dtype=torch.bfloat16)
    n = x.numel()
    one = n * (2 + 1 + 4 / 128)  # read bf16, write e4m3 and a float32 scale per 128
    dst = torch.empty_like(x)
    rows = [_row(group, "device-to-device copy (limit)", lambda: dst.copy_(x), 4.0 * n, "GB/s")]
    # _row reports a compile failure as a failed row
    compiled = torch.compile(_plain_block_cast)
    rows.append(_row(group, "plain PyTorch 1x128 cast, torch.compile (anchor)", lambda: compiled(x), one, "GB/s"))
    if importlib.util.find_spec("torchao") is not None:
        try:
            from torchao.prototype.mx_formats.mx_tensor import to_mx

            to_mx_c = torch.compile(lambda t: to_mx(t, torch.float8_e4m3fn, 32))
            rows.append(_row(group, "torchao to_mx (MX, 1x32), torch.compile", lambda: to_mx_c(x),
                             n * (2 + 1 + 1 / 32), "GB/s"))
        except Exception as exc:  # noqa: BLE001
            rows.append(Row(group, "torchao to_mx, torch.compile", float("nan"), 0, "GB/s", note=repr(exc)[:80]))
    else:
        rows.append(Row(group, "torchao to_mx, torch.compile", float("nan"), 0, "GB/s", note="torchao not installed"))
    compiled_both = torch.compile(_plain_block_cast_both)
    rows.append(_row(group, "plain PyTorch rows + transposed columns, torch.compile (anchor)",
                     lambda: compiled_both(x), n * (2 + 2 + 8 / 128), "GB/s"))
    anchor = rows[1].rate or None
    anchor_both = rows[-1].rate or None
    ref_rows, ref_cols = fb.quantize_act(x[:256].cpu(), backend="reference")

    def exact_note(got_rows, got_cols=None) -> str:
        """Bit-exact against the reference on the first 256 tokens."""
        ok = (torch.equal(got_rows.data[:256].view(torch.uint8).cpu(), ref_rows.data.view(torch.uint8))
              and torch.equal(got_rows.scale[:256].cpu(), ref_rows.scale))
        if got_cols is not None:
            ok = ok and torch.equal(got_cols.data[:, :256].view(torch.uint8).cpu(), ref_cols.data.view(torch.uint8))
            ok = ok and torch.equal(got_cols.scale[:, :2].cpu(), ref_cols.scale)
        return "bit-exact on the first 256 tokens" if ok else "MISMATCH against the reference"

    rows.append(_row(group, "fp8_block rows (1x128)", lambda: fb.quantize_rows(x), one, "GB/s", anchor,
                     check=lambda: exact_note(fb.quantize_rows(x))))
    rows.append(_row(group, "fp8_block rows + transposed columns (1x128 and 128x1), one read",
                     lambda: fb.quantize_act(x), n * (2 + 2 + 8 / 128), "GB/s", anchor_both,
                     check=lambda: exact_note(*fb.quantize_act(x))))
    w = torch.randn(4096, K, device="cuda", dtype=torch.bfloat16)
    ref_w, ref_wt = fb.quantize_weight(w[:256].cpu(), backend="reference")

    def weight_note() -> str:
        """Both copies bit-exact against the reference on the first 256 rows (two block rows)."""
        got, got_t = fb.quantize_weight(w)
        ok = all(torch.equal(g.view(torch.uint8).cpu(), r.view(torch.uint8)) for g, r in
                 ((got.data[:256], ref_w.data), (got_t.data[:, :256], ref_wt.data)))
        ok = (ok and torch.equal(got.scale[:2].cpu(), ref_w.scale)
              and torch.equal(got_t.scale[:, :2].cpu(), ref_wt.scale))
        return "bit-exact on the first 256 rows" if ok else "MISMATCH against the reference"

    rows.append(_row(group.replace(f"{tokens}x", "weight 4096x"), "fp8_block weight 128x128 + transpose, one read",
                     lambda: fb.quantize_weight(w), w.numel() * (2 + 2), "GB/s", check=weight_note))
    return rows


def fp8_rows() -> list[Row]:
    rows = bench_cast(24576, 4096)
    rows += bench_gemm(SQUARE, SQUARE, SQUARE, TRITON_TILES)
    for M, K, N in MODEL_SHAPES:
        rows += bench_gemm(M, K, N)
    for shape in LINEAR_SHAPES:
        rows += bench_linear(*shape)
    return rows
