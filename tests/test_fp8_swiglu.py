"""FP8BlockSwiGLU: the fused SwiGLU MLP in block-scaled FP8 against float64 and against the same
MLP built from two FP8BlockLinear layers, with gradients; its bad input; the fp8_block policy's
``fp8_fused_mlp`` switch; and the fused kernels under TRITON_INTERPRET=1 (in a subprocess)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gemcore.kernels.fp8_block import FP8BlockLinear
from gemcore.kernels.fp8_swiglu import FP8BlockSwiGLU
from tests.test_fp8_block import rel_err

#: relative Frobenius error against float64 of a SwiGLU MLP whose GEMM operands are all E4M3 (3
#: mantissa bits): about 0.065 for the output and each gradient, fused or not
FP8_MLP_BOUND = 0.08
#: fused against the two FP8BlockLinear layers: the same quantization, except that the fused MLP
#: rounds its activations to bf16 before their casts (measured: about 0.017)
FUSED_VS_LAYERS_BOUND = 0.03


def _mlp(hidden=128, inner=256, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(hidden, 2 * inner, bias=False), nn.Linear(inner, hidden, bias=False)


def _float64_mlp(x, w_gate_up, w_down):
    g, u = F.linear(x.double(), w_gate_up.double()).chunk(2, dim=-1)
    return F.linear(F.silu(g) * u, w_down.double())


def _output_and_grads(run, x, params, dy):
    """run(x) and the gradients of (x, *params) for output gradient dy."""
    x = x.detach().clone().requires_grad_(True)
    for p in params:
        p.grad = None
    y = run(x)
    y.backward(dy.to(y.dtype))
    return [y.detach(), x.grad, *[p.grad for p in params]]


@pytest.mark.parametrize("M", [300, 1, 0])
def test_matches_float64_and_the_unfused_layers_with_gradients(M):
    gate_up, down = _mlp()
    params = [gate_up.weight, down.weight]
    fused = FP8BlockSwiGLU(gate_up, down, matmul="reference", cast="reference")
    a = FP8BlockLinear.from_linear(gate_up, matmul="reference")
    b = FP8BlockLinear.from_linear(down, matmul="reference")

    def layers(x):
        g, u = a(x).chunk(2, dim=-1)
        return b(F.silu(g) * u)

    x, dy = torch.randn(M, 128), torch.randn(M, 128)
    got = _output_and_grads(fused, x, params, dy)
    assert got[0].shape == (M, 128) and got[0].dtype == torch.float32
    unfused = _output_and_grads(layers, x, params, dy)
    w64 = [p.detach().double().requires_grad_(True) for p in params]
    exact = _output_and_grads(lambda x: _float64_mlp(x, *w64), x.double(), w64, dy.double())
    if M == 0:
        assert all(float(t.abs().sum()) == 0 for t in got[2:])
        return
    for name, g, u, e in zip(["y", "dx", "d gate_up", "d down"], got, unfused, exact):
        assert rel_err(g, e) < FP8_MLP_BOUND, name
        assert rel_err(g, u) < FUSED_VS_LAYERS_BOUND, name


def test_under_bf16_autocast_the_output_is_bf16():
    gate_up, down = _mlp()
    fused = FP8BlockSwiGLU(gate_up, down, matmul="reference", cast="reference")
    x = torch.randn(2, 50, 128)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused(x)
    assert y.shape == (2, 50, 128) and y.dtype == torch.bfloat16
    want = _float64_mlp(x.reshape(-1, 128), gate_up.weight, down.weight).reshape(2, 50, 128)
    assert rel_err(y, want) < FP8_MLP_BOUND


def test_shares_the_layers_parameters():
    gate_up, down = _mlp()
    fused = FP8BlockSwiGLU(gate_up, down)
    assert fused.gate_up.weight is gate_up.weight and fused.down.weight is down.weight
    assert [n for n, _ in fused.named_parameters()] == ["gate_up.weight", "down.weight"]


def test_bad_input_is_named():
    gate_up, down = _mlp()
    with pytest.raises(ValueError, match="gate_up must be an nn.Linear without bias"):
        FP8BlockSwiGLU(nn.Linear(128, 512), down)
    with pytest.raises(ValueError, match="F a multiple of 128 and down's in_features F"):
        FP8BlockSwiGLU(nn.Linear(128, 400, bias=False), nn.Linear(200, 128, bias=False))
    with pytest.raises(ValueError, match="matmul must be one of"):
        FP8BlockSwiGLU(gate_up, down, matmul="fast")
    ref_gate_up = FP8BlockLinear.from_linear(gate_up, matmul="reference")
    with pytest.raises(ValueError, match="gate_up is an FP8BlockLinear with .*matmul='reference'.* but the options ask"):
        FP8BlockSwiGLU(ref_gate_up, down, matmul="cublas")
    with pytest.raises(ValueError, match="gate_up and down must share one FP8BlockConfig"):
        FP8BlockSwiGLU(ref_gate_up, FP8BlockLinear.from_linear(down, matmul="triton"))
    both = FP8BlockSwiGLU(ref_gate_up, down, matmul="reference")  # down converted with the same options
    assert both.fp8_config == both.down.fp8_config == ref_gate_up.fp8_config
    fused = FP8BlockSwiGLU(gate_up, down, matmul="reference")
    with pytest.raises(ValueError, match="x: last dimension must be in_features=128"):
        fused(torch.randn(4, 64))
    with pytest.raises(ValueError, match="x must be float32/bfloat16/float16"):
        fused(torch.zeros(4, 128, dtype=torch.int64))


def test_policy_fuses_the_mlps_when_asked_and_trains():
    from gemcore.config import AttentionConfig, ModelConfig, PrecisionConfig
    from gemcore.data import make_synthetic
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import MLP, GemModel
    from gemcore.plugin_manager import create_plugin_manager

    cfg = ModelConfig(num_items=200, hidden=128, num_blocks=2, num_heads=2, mlp_ratio=2)
    data = make_synthetic(num_users=64, num_items=200, num_actions=4, max_len=12, num_candidates=2,
                          num_clusters=8, kind="uniform", seed=0)
    factory = create_plugin_manager().resolve("precision", "fp8_block").factory
    losses = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))
        policy = factory(PrecisionConfig(impl="fp8_block", fp8_fused_mlp=fused))
        model = policy.apply(model)
        mlps = [m for m in model.modules() if isinstance(m, (MLP, FP8BlockSwiGLU))]
        assert all(isinstance(m, FP8BlockSwiGLU) == fused for m in mlps) and len(mlps) == 2
        assert ("blocks.0.mlp.gate_up" in policy.converted) and policy.fused_mlps == (
            ["blocks.0.mlp", "blocks.1.mlp"] if fused else [])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):
            batch = data.__getitems__(list(range(16 * step, 16 * step + 16)))
            with policy.autocast("cpu"):
                loss = model.loss(batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
        losses[fused] = float(loss.detach())
    assert abs(losses[True] - losses[False]) < 0.02 * abs(losses[False])


def test_fused_kernels_in_interpreter():
    """Runs test_fp8_swiglu_triton.py with TRITON_INTERPRET=1 (set before triton is imported)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: test_fp8_swiglu_triton.py runs on it directly")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(Path(__file__).parent / "test_fp8_swiglu_triton.py")], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.mark.parametrize("backward", [False, True])
def test_fused_kernel_compiles_for_sm90_with_the_installed_triton(backward):
    """No GPU needed: the kernel builds for Hopper and its PTX rounds to bf16 and converts to E4M3
    in hardware, after the flushing multiply of the reference's subnormal rule."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from gemcore.kernels.fp8_swiglu_triton import SWIGLU_TILE, SWIGLU_WARPS, _swiglu_cast

    ints = ["M", "F", "R_PAD", "C_PAD", "stride_gm", "stride_gc", "stride_dm", "stride_dc", "stride_rsr",
            "stride_rsc", "stride_csr", "stride_csc"]
    signature = dict(gu_ptr="*bf16", dh_ptr="*bf16", rdata_ptr="*u8", rscale_ptr="*fp32", cdata_ptr="*u8",
                     cscale_ptr="*fp32", **dict.fromkeys(ints, "i32"), BACKWARD="constexpr", BLOCK_R="constexpr",
                     SOFT_ROUND="constexpr")
    src = ASTSource(_swiglu_cast, signature, constexprs={"BACKWARD": backward, "BLOCK_R": SWIGLU_TILE["BLOCK_R"],
                                                         "SOFT_ROUND": False})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": SWIGLU_WARPS["backward" if backward else "forward"]})
    ptx = compiled.asm["ptx"]
    assert "cvt.rn.bf16" in ptx and "e4m3x2" in ptx and "mul.rn.ftz.f32" in ptx
