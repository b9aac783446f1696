"""Block-scaled FP8 (DeepSeek-V3's recipe): reference semantics, GEMM and FP8BlockLinear accuracy
against float64, bad input, and the ``fp8_block`` precision plugin training on CPU.

The Triton kernels are tested in test_fp8_block_triton.py (started here under TRITON_INTERPRET=1;
on a GPU it runs directly, with the cuBLAS backend too).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from gemcore.kernels import fp8_block as fb
from gemcore.kernels.fp8_block_reference import quantize_rows_reference, quantize_square_reference

#: the rule for fast paths: relative Frobenius error against float64 of the dequantized operands
FAST_PATH_BOUND = 1e-3


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def block_data(kind: str, shape, seed: int, rows_per_block: int = 1) -> torch.Tensor:
    """randn | spread (each block's magnitude 2^U[-40, 40]) | zero (every other block all zero) |
    tiny (blocks around 2^-120; multiplied with randn partners, as their products would
    underflow float32)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    R, C = shape
    nb = (-(-R // rows_per_block), -(-C // 128))
    if kind == "spread":
        e = torch.randint(-40, 41, nb, generator=g).float()
    elif kind == "zero":  # every other block all zero
        e = torch.where(torch.arange(nb[0] * nb[1]).reshape(nb) % 2 == 0, 0.0, -math.inf)
    elif kind == "tiny":  # near float32's underflow: the scale clamps at 2^-126
        e = torch.full(nb, -120.0) + torch.randint(-3, 4, nb, generator=g).float()
    else:
        return x
    f = torch.exp2(e).repeat_interleave(rows_per_block, 0).repeat_interleave(128, 1)[:R, :C]
    return x * f


def partner(kind: str) -> str:
    """The data kind a GEMM multiplies ``kind`` with (tiny times tiny would underflow float32)."""
    return "randn" if kind == "tiny" else kind


# --------------------------------------------------------------------------- reference semantics
@pytest.mark.parametrize("kind", ["randn", "spread", "zero", "tiny"])
def test_reference_cast_semantics(kind):
    """Power-of-two scales with amax in (224, 448] * scale (unless clamped), elements equal to
    torch's own nearest-even E4M3 cast of x / scale."""
    x = block_data(kind, (70, 384), seed=1)
    data, scale = quantize_rows_reference(x)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (70, 3) and scale.dtype == torch.float32
    mant, _ = torch.frexp(scale)
    assert torch.all(mant == 0.5)  # powers of two
    amax = x.abs().reshape(70, 3, 128).amax(-1)
    amax = torch.where(amax < 2.0**-126, 0.0, amax)
    free = scale > 2.0**-126  # not clamped
    assert torch.all(amax <= 448 * scale) and torch.all(amax[free] > 224 * scale[free])
    assert torch.all(scale[amax == 0] == 2.0**-126)
    if kind == "tiny":
        assert (~free).any()
    s = scale.repeat_interleave(128, 1)
    flushed = torch.where(x.abs() < 2.0**-126, x * 0.0, x)  # float32 subnormals read as zero
    want = (flushed / s).to(torch.float8_e4m3fn)
    assert torch.equal(data.view(torch.uint8), want.view(torch.uint8))
    deq = fb.BlockFP8(data, scale, 1).dequantize(torch.float64)
    assert rel_err(deq, x) <= 2.0**-4


def test_reference_square_blocks_and_specials():
    w = block_data("spread", (256, 384), seed=2, rows_per_block=128)
    w[5, 7] = math.nan
    w[200, 300] = -math.inf
    data, scale = quantize_square_reference(w)
    assert scale.shape == (2, 3)
    assert math.isnan(scale[0, 0]) and math.isnan(scale[1, 2]) and torch.isfinite(scale).sum() == 4
    assert torch.isnan(data[:128, :128].float()).all()
    amax = w.abs().reshape(2, 128, 3, 128).amax((1, 3))
    ok = torch.isfinite(scale)
    assert torch.all(amax[ok] <= 448 * scale[ok]) and torch.all(amax[ok] > 224 * scale[ok])


def test_padding_and_layouts():
    x = torch.randn(130, 200)
    rows, cols = fb.quantize_act(x, backend="reference")
    assert rows.data.shape == (256, 256) and cols.data.shape == (256, 256)
    assert rows.scale.shape == (256, 2) and rows.scale.stride() == (1, 256)  # column-major
    assert torch.equal(rows.dequantize()[:130, :200], quantize_rows_reference(
        torch.nn.functional.pad(x, (0, 56)))[0].float()[:, :200] * rows.scale[:130].repeat_interleave(128, 1)[:, :200])
    assert torch.all(rows.dequantize()[130:] == 0) and torch.all(cols.dequantize()[200:] == 0)
    assert rel_err(cols.dequantize()[:200, :130], x.t()) <= 2.0**-4
    w, wt = fb.quantize_weight(torch.randn(256, 384))
    assert torch.equal(wt.data.view(torch.uint8), w.data.t().view(torch.uint8))
    assert torch.equal(wt.scale, w.scale.t())


# --------------------------------------------------------------------------- GEMM accuracy
@pytest.mark.parametrize("kind", ["randn", "spread", "zero", "tiny"])
@pytest.mark.parametrize("b_blocks", [1, 128])
def test_reference_gemm_against_float64(kind, b_blocks):
    a = fb.quantize_rows(block_data(kind, (96, 384), seed=3), pad=True)
    bx = block_data(partner(kind), (256, 384), seed=4, rows_per_block=b_blocks)
    b = fb.quantize_rows(bx) if b_blocks == 1 else fb.quantize_weight(bx, transpose=False)[0]
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64).t()
    got = fb.fp8_block_mm(a, b, torch.float32, backend="reference")
    assert got.shape == (128, 256) and got.dtype == torch.float32
    assert rel_err(got, want) <= FAST_PATH_BOUND
    assert fb.fp8_block_mm(a, b).dtype == torch.bfloat16


def fp8_exact_linear(x, w, dy):
    """FP8BlockLinear's forward and gradients composed from the casts and float64 products."""
    M, K = x.shape
    N = w.shape[0]
    xr, xc = fb.quantize_act(x, backend="reference")
    wq, wt = fb.quantize_weight(w, pad=True, backend="reference")
    dr, dc = fb.quantize_act(dy, backend="reference")
    d = lambda t: t.dequantize(torch.float64)  # noqa: E731
    y = (d(xr) @ d(wq).t())[:M, :N]
    dx = (d(dr) @ d(wt).t())[:M, :K]
    dw = (d(dc) @ d(xc).t())[:N, :K]
    return y, dx, dw


@pytest.mark.parametrize("kind", ["randn", "spread", "zero", "tiny"])
@pytest.mark.parametrize("M,K,N", [(150, 256, 384), (1, 64, 40), (0, 128, 128)])
def test_linear_reference_against_float64(kind, M, K, N):
    x = block_data(kind, (M, K), seed=5).requires_grad_()
    lin = fb.FP8BlockLinear(K, N, bias=True, matmul="reference")
    with torch.no_grad():
        lin.weight.copy_(block_data(partner(kind), (N, K), seed=6, rows_per_block=128))
        lin.bias.zero_()  # (a bias would swamp the tiny outputs)
    dy = block_data(partner(kind), (M, N), seed=7)
    y = lin(x)
    assert y.shape == (M, N) and y.dtype == torch.float32
    y.backward(dy)
    want_y, want_dx, want_dw = fp8_exact_linear(x.detach(), lin.weight.detach(), dy)
    if M == 0:
        assert x.grad.shape == (0, K) and torch.all(lin.weight.grad == 0)
        return
    assert rel_err(y, want_y) <= FAST_PATH_BOUND
    assert rel_err(x.grad, want_dx) <= FAST_PATH_BOUND
    assert rel_err(lin.weight.grad, want_dw) <= FAST_PATH_BOUND
    assert torch.allclose(lin.bias.grad, dy.sum(0))
    if kind == "randn":  # and the FP8 result is close to the unquantized layer's
        ref = x.detach() @ lin.weight.detach().t()
        assert rel_err(y, ref) <= 0.1


def test_linear_under_autocast_and_batched_input():
    lin = fb.FP8BlockLinear(128, 256, matmul="reference")
    x = torch.randn(2, 5, 128, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.shape == (2, 5, 256) and y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.shape == x.shape and lin.weight.grad.dtype == torch.float32


# --------------------------------------------------------------------------- bad input
def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="x: the last dimension must be a multiple of 128"):
        fb.quantize_rows(torch.randn(4, 100))
    with pytest.raises(ValueError, match="w: the first dimension must be a multiple of 128"):
        fb.quantize_weight(torch.randn(100, 128))
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16/float64"):
        fb.quantize_rows(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16/float64"):
        fb.quantize_rows(torch.zeros(4, 128).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="x must be 2-D"):
        fb.quantize_rows(torch.randn(128))
    with pytest.raises(ValueError, match="backend must be one of"):
        fb.quantize_rows(torch.randn(4, 128), backend="cuda")
    a = fb.quantize_rows(torch.randn(4, 128))
    b = fb.quantize_rows(torch.randn(4, 256))
    with pytest.raises(ValueError, match="disagree on K"):
        fb.fp8_block_mm(a, b)
    with pytest.raises(ValueError, match="a must be in 1x128 blocks"):
        fb.fp8_block_mm(fb.quantize_weight(torch.randn(128, 128))[0], a)
    with pytest.raises(ValueError, match="backend must be one of"):
        fb.fp8_block_mm(a, a, backend="fast")
    with pytest.raises(ValueError, match="out_dtype"):
        fb.fp8_block_mm(a, a, out_dtype=torch.int8)
    with pytest.raises(ValueError, match="matmul must be one of"):
        fb.FP8BlockLinear(128, 128, matmul="tensorwise")
    with pytest.raises(ValueError, match="in_features"):
        fb.FP8BlockLinear(128, 128)(torch.randn(2, 64))
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16"):
        fb.FP8BlockLinear(128, 128)(torch.randn(2, 128, dtype=torch.float64))


@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="checks the errors of a machine without a GPU")
def test_fast_paths_without_gpu_raise():
    a = fb.quantize_rows(torch.randn(4, 128))
    for backend in ("cublas", "triton"):
        with pytest.raises(ValueError, match=f"matmul backend '{backend}' cannot run on cpu"):
            fb.fp8_block_mm(a, a, backend=backend)
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA tensor"):
        fb.quantize_rows(torch.randn(4, 128), backend="triton")
    assert fb.resolve_matmul_backend("auto", torch.device("cpu")) == "reference"
    status = fb.matmul_backend_status(torch.device("cpu"))
    assert status["reference"] is None and "CUDA" in status["cublas"]


def test_gpu_without_fp8_is_refused(monkeypatch):
    """A GPU below compute capability 8.9 asked for a fast path gets an error naming it."""
    monkeypatch.setattr(fb, "_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    status = fb.matmul_backend_status(torch.device("cuda", 0))
    assert "sm >= 8.9" in status["triton"]
    with pytest.raises(ValueError, match="needs a GPU with FP8 tensor cores .* A100 has 8.0"):
        fb._require_fp8_gpu(torch.device("cuda", 0), "the FP8 cast")
    with pytest.raises(ValueError, match="no block-scaled FP8 GEMM has been verified on compute capability 8.0"):
        fb.resolve_matmul_backend("auto", torch.device("cuda", 0))


@pytest.mark.parametrize("runs,padded,square,want", [
    ({"cublas", "scaled_mm", "triton"}, True, (2, 3), "cublas"),      # torch takes padded scales
    ({"cublas", "scaled_mm", "triton"}, False, (2, 8), "cublas"),     # K/128 a multiple of 4
    ({"cublas", "scaled_mm", "triton"}, False, None, "cublas"),       # no 128x128 operand
    ({"cublas", "scaled_mm", "triton"}, False, (2, 3), "scaled_mm"),  # cuBLAS can't take these scales
    ({"cublas", "triton"}, False, (2, 3), "triton"),
    ({"triton"}, True, (2, 3), "triton"),                             # no cuBLAS block scaling here
])
def test_auto_on_hopper_takes_the_first_backend_that_runs_the_gemm(monkeypatch, runs, padded, square, want):
    monkeypatch.setattr(fb, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(fb, "_AUTO_CHOICES", {})
    monkeypatch.setattr(fb, "_cublas_takes_padded_scales", lambda device: padded)
    monkeypatch.setattr(fb, "matmul_backend_status", lambda device: {
        name: None if name in runs else f"{name} cannot run here" for name in ("reference", "cublas", "scaled_mm", "triton")})
    assert fb.resolve_matmul_backend("auto", torch.device("cuda", 0), square) == want
    assert fb.resolve_matmul_backend("auto", torch.device("cuda", 0), square) == want  # remembered


def test_auto_choices_are_made_when_a_layer_lands_on_the_gpu(monkeypatch):
    """learn_device (run when an FP8BlockLinear's weight reaches a GPU) settles auto's backend for
    the layer's forward, dgrad and wgrad GEMMs, so torch.compile never traces the probes."""
    monkeypatch.setattr(fb, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(fb, "_AUTO_CHOICES", {})
    monkeypatch.setattr(fb, "_cublas_takes_padded_scales", lambda device: False)
    monkeypatch.setattr(fb, "matmul_backend_status", lambda device: {
        name: None for name in ("reference", "cublas", "scaled_mm", "triton")})
    assert fb.layer_gemm_keys((3072, 1024)) == [(24, 8), (8, 24), None]
    fb.learn_device(torch.device("cuda", 0), "auto", (3072, 1000))  # K padded: 8 blocks
    assert fb._AUTO_CHOICES == {(0, (24, 8)): "cublas", (0, (8, 24)): "cublas", (0, None): "cublas"}
    fb.learn_device(torch.device("cuda", 0), "auto", (384, 384))     # 3x3 blocks: cuBLAS can't take them
    assert fb._AUTO_CHOICES[(0, (3, 3))] == "scaled_mm"
    fb._AUTO_CHOICES.clear()
    fb.learn_device(torch.device("cuda", 0), "cublas", (3072, 1024))  # an explicit backend: nothing to settle
    assert fb._AUTO_CHOICES == {}
    monkeypatch.setattr(fb, "_capability", lambda device: (8, 0))      # not covered by auto: forward says so
    fb.learn_device(torch.device("cuda", 0), "auto", (3072, 1024))
    assert fb._AUTO_CHOICES == {}


def test_auto_on_hopper_with_no_runnable_backend_says_why(monkeypatch):
    monkeypatch.setattr(fb, "_capability", lambda device: (9, 0))
    monkeypatch.setattr(fb, "_AUTO_CHOICES", {})
    monkeypatch.setattr(fb, "matmul_backend_status", lambda device: {
        "reference": None, "cublas": "CUDA 12.4", "scaled_mm": "no recipes", "triton": "no FP8"})
    with pytest.raises(ValueError, match="none of cublas, scaled_mm, triton runs on cuda:0: cublas: CUDA 12.4"):
        fb.resolve_matmul_backend("auto", torch.device("cuda", 0))


# --------------------------------------------------------------------------- plugin and training
def test_plugin_registers_and_trains_on_cpu():
    from gemcore.config import PrecisionConfig
    from gemcore.plugin_manager import create_plugin_manager
    from tests.test_mx import _tiny_setup  # the same tiny model the MX policy trains

    impl = create_plugin_manager().resolve("precision", "fp8_block")
    policy = impl.factory(PrecisionConfig(impl="fp8_block"))
    assert policy.name == "fp8_block" and policy.compute_dtype == torch.bfloat16
    model, data = _tiny_setup()
    model = policy.apply(model)
    converted = {n for n, m in model.named_modules() if isinstance(m, fb.FP8BlockLinear)}
    assert converted == set(policy.converted) and "blocks.0.qkv" in converted
    assert not any("router" in n or n.startswith("head") for n in converted)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(15):
        batch = data.__getitems__(list(range(16 * (step % 4), 16 * (step % 4) + 16)))
        with policy.autocast("cpu"):
            loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_gem_train_cli_with_fp8_block(tmp_path, monkeypatch):
    """`gem train --set precision.impl=fp8_block` trains, and its GEMMs go through fp8_block_mm."""
    from tests.conftest import gem, tiny_set_args

    calls = []
    real = fb.fp8_block_mm
    monkeypatch.setattr(fb, "fp8_block_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    result = gem(["train", "--name", "fp8", "--max-steps", "4", "--quiet",
                  *tiny_set_args(["precision.impl=fp8_block"])], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert len(calls) >= 4 * 3  # forward, dgrad and wgrad of at least one layer per step


def test_triton_kernels_in_interpreter():
    """Runs test_fp8_block_triton.py with TRITON_INTERPRET=1 (set before triton is imported)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: test_fp8_block_triton.py runs on it directly")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_fp8_block_triton.py")], env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


def test_gem_info_says_what_each_gpu_generation_gets(tmp_path, monkeypatch):
    from tests.conftest import gem

    result = gem(["info"], tmp_path, monkeypatch)
    assert result.returncode == 0
    out = result.stdout
    assert "low precision by GPU generation" in out
    assert "9.0   Hopper: fp8_block matmul=cublas" in out and "tl.dot_scaled" in out
    assert "fp8_block GEMM backends here: reference" in out
    assert fb.generation_of((9, 0)) == (9, 0) and fb.generation_of((7, 5)) == (8, 0)
    assert fb.generation_of((10, 3)) == (10, 0) and fb.generation_of((8, 9)) == (8, 9)
    # auto only names backends verified on a generation
    assert all(set(row) <= set(fb.MATMUL_BACKENDS) - {"auto", "reference"} for row in fb.AUTO_CUDA_MATMUL.values())


@pytest.mark.parametrize("K", [512, 384, 128])
@pytest.mark.parametrize("b_blocks", [1, 128])
def test_cublas_layouts_pass_torchs_checks(K, b_blocks):
    """The scale layouts handed to torch._scaled_mm and torch.nn.functional.scaled_mm pass torch's
    own shape and stride checks (run on the meta device: no GPU needed)."""
    def meta(t: fb.BlockFP8) -> fb.BlockFP8:
        return fb.BlockFP8(*(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
                             for v in (t.data, t.scale)), t.block_rows)

    a = meta(fb.quantize_rows(torch.randn(256, K)))
    bx = torch.randn(384, K)
    b = meta(fb.quantize_rows(bx) if b_blocks == 1 else fb.quantize_weight(bx, transpose=False)[0])
    for mm in (fb._cublas_mm, fb._functional_mm):
        for out_dtype in (torch.float32, torch.bfloat16):
            out = mm(a, b, out_dtype)
            assert out.shape == (256, 384) and out.dtype == out_dtype


def test_bench_cast_anchors_do_the_same_work():
    """`gem bench mx`'s plain-PyTorch cast anchors write what the casts they stand beside write
    (randn data): rows, and rows + transposed columns."""
    from gemcore.bench.fp8 import _plain_block_cast, _plain_block_cast_both

    x = torch.randn(256, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want_rows, want_cols = fb.quantize_act(x, backend="reference")
    (rows, rows_scale), (cols, cols_scale) = _plain_block_cast_both(x)
    assert torch.equal(_plain_block_cast(x)[0].view(torch.uint8), want_rows.data.view(torch.uint8))
    assert torch.equal(rows.view(torch.uint8), want_rows.data.view(torch.uint8))
    assert torch.equal(cols.view(torch.uint8), want_cols.data.view(torch.uint8))
    assert torch.equal(rows_scale.squeeze(-1), want_rows.scale) and torch.equal(cols_scale.squeeze(-1), want_cols.scale)
