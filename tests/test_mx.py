"""MX (OCP Microscaling) semantics, MXLinear, convert_to_mx and the ``mxfp8`` precision plugin.

The cast is checked against an independent bit-level model written here in NumPy: scale bytes
from integer arithmetic on float32 exponent fields, elements by nearest-even search over a table of
all 256 FP8 codes decoded from their bit fields (no torch or ml_dtypes float8 casts involved).
The Triton kernels are tested in test_mx_triton.py (started here under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from gemcore.kernels import mx
from gemcore.kernels.mx_reference import FORMATS

EMAX = {"e4m3": 8, "e5m2": 15}
MAX_NORMAL = {"e4m3": 448.0, "e5m2": 57344.0}


# --------------------------------------------------------------------------- independent model
def fp8_table(elem: str) -> np.ndarray:
    """Value of each of the 256 codes, decoded from sign/exponent/mantissa fields."""
    values = np.empty(256)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        if elem == "e4m3":
            e, m = (code >> 3) & 0xF, code & 0x7
            v = math.nan if (e == 15 and m == 7) else (m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
        else:
            e, m = (code >> 2) & 0x1F, code & 0x3
            v = (math.inf if m == 0 else math.nan) if e == 31 else (
                m * 2.0**-16 if e == 0 else (1 + m / 4) * 2.0 ** (e - 15))
        values[code] = sign * v
    return values


def encode_nearest_even(y: np.ndarray, elem: str) -> np.ndarray:
    """float64 -> code: nearest finite code, ties to the even code, saturating; sign of zero kept."""
    table = fp8_table(elem)
    codes = np.array([c for c in range(128) if np.isfinite(table[c])])  # non-negative finite codes
    values = table[codes]
    order = np.argsort(values)
    codes, values = codes[order], values[order]
    a = np.minimum(np.abs(y), values[-1])
    hi = np.clip(np.searchsorted(values, a), 0, len(values) - 1)
    lo = np.clip(hi - 1, 0, len(values) - 1)
    d_lo, d_hi = a - values[lo], values[hi] - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    out = np.where(pick_hi, codes[hi], codes[lo])
    return (out | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def bit_model(x: torch.Tensor, elem: str, scale_rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes, scale bytes) of a 2-D float tensor blocked along its last axis."""
    x32 = x.float().numpy()
    rows, length = x32.shape
    nb = -(-length // 32)
    padded = np.zeros((rows, nb * 32), np.float32)
    padded[:, :length] = x32
    blocks = padded.reshape(rows, nb, 32)
    bits = (blocks.view(np.uint32) & 0x7FFFFFFF).astype(np.int64)
    amax_bits = bits.max(axis=-1)
    byte = (amax_bits >> 23) - EMAX[elem]
    if scale_rule == "rceil":
        byte += (amax_bits & 0x7FFFFF) > 0x600000
    byte = np.clip(byte, 0, 254)
    byte = np.where(amax_bits >= 0x7F800000, 255, byte)
    exponent = np.where(byte == 255, 0, byte - 127).astype(np.float64)
    scaled = blocks.astype(np.float64) / np.exp2(exponent)[..., None]
    codes = encode_nearest_even(np.nan_to_num(scaled, nan=0.0, posinf=0.0, neginf=0.0), elem)
    codes = np.where((byte == 255)[..., None], 0x7F, codes)
    return codes.reshape(rows, nb * 32)[:, :length], byte.astype(np.uint8)


def assert_matches_model(x: torch.Tensor, elem: str, scale_rule: str, axis: int) -> mx.MXTensor:
    t = mx.quantize_mx(x, elem=elem, axis=axis, scale_rule=scale_rule, backend="reference")
    moved = x.movedim(axis, -1)
    flat = moved.reshape(-1, moved.shape[-1])
    codes, scale = bit_model(flat, elem, scale_rule)
    got_codes = t.data.view(torch.uint8).movedim(axis, -1).reshape(flat.shape).numpy()
    got_scale = t.scale.movedim(axis, -1).reshape(flat.shape[0], -1).numpy()
    np.testing.assert_array_equal(got_scale, scale)
    np.testing.assert_array_equal(got_codes, codes)
    return t


def random_magnitudes(shape, seed, lo=-30, hi=30, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(lo, hi, shape, generator=g).float())
    x.view(-1)[:: 7] *= 2.0 ** -14  # elements far below their block's amax: subnormals
    return x.to(dtype)


# --------------------------------------------------------------------------- cast semantics
@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_rule", ["floor", "rceil"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_random_data_matches_bit_model(elem, scale_rule, dtype):
    lo, hi = (-12, 12) if dtype == torch.float16 else (-60, 60)
    for seed, (shape, axis) in enumerate([((7, 96), -1), ((5, 70), 1), ((70, 3), 0), ((2, 45, 3), 1),
                                          ((1, 1), -1), ((3, 33), -1)]):
        x = random_magnitudes(shape, seed, lo, hi, dtype)
        t = assert_matches_model(x, elem, scale_rule, axis)
        assert t.data.dtype == FORMATS[elem].dtype and t.data.shape == x.shape
        expect = list(x.shape)
        expect[axis] = -(-expect[axis] // 32)
        assert list(t.scale.shape) == expect and t.scale.dtype == torch.uint8
        assert (t.elem, t.block, t.axis, t.scale_rule) == (elem, 32, axis % x.dim(), scale_rule)


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
@pytest.mark.parametrize("scale_rule", ["floor", "rceil"])
def test_edges_match_bit_model(elem, scale_rule):
    mn = MAX_NORMAL[elem]
    f32 = torch.float32
    ulp_up = lambda v: torch.nextafter(torch.tensor(v, dtype=f32), torch.tensor(math.inf, dtype=f32)).item()
    rows = [
        [0.0] * 32,  # zero block
        [-0.0] * 31 + [1.0],  # signed zeros kept
        [mn] + [1.0] * 31,  # amax exactly max_normal
        [mn * 2.0**5] + [3.0] * 31,  # exactly max_normal * 2^k
        [ulp_up(mn)] + [0.5] * 31,  # just above max_normal
        [ulp_up(mn * 2.0**-9)] + [-0.25] * 31,
        [mn * 1.1] + [-mn * 1.09] * 31,  # floor saturates
        [1.0] + [2.0**-15, -2.0**-17, 2.0**-20, 3 * 2.0**-16] * 7 + [0.0] * 3,  # subnormal elements
        [1e-40, -3e-41, 1e-45] + [0.0] * 29,  # float32 subnormal input (E clamps at -127)
        [3.0e38, -1.0, 1e30] + [2.0] * 29,  # huge
        [2.0**-130] * 32,
        [1.5 * 2.0**-9, 2.5 * 2.0**-9] + [1.0] * 30,  # ties
    ]
    x = torch.tensor(rows, dtype=f32)
    assert_matches_model(x, elem, scale_rule, -1)
    assert_matches_model(x.t().contiguous(), elem, scale_rule, 0)


def test_special_blocks():
    x = torch.ones(4, 70)
    x[0, :32] = 0.0
    x[1, 5] = math.nan
    x[2, 40] = math.inf
    x[3, 69] = -math.inf
    for elem in ("e4m3", "e5m2"):
        t = mx.quantize_mx(x, elem=elem)
        assert t.scale[0, 0] == 0 and (t.data[0, :32].view(torch.uint8) == 0).all()
        assert t.scale[1, 0] == 0xFF and t.scale[2, 1] == 0xFF and t.scale[3, 2] == 0xFF
        d = t.dequantize()
        assert d[1, :32].isnan().all() and d[2, 32:64].isnan().all() and d[3, 64:].isnan().all()
        assert not d[1, 32:].isnan().any() and not d[3, :64].isnan().any()
        assert (d[0, :32] == 0).all() and (d[0, 32:] == 1).all()


def test_scale_rules_and_saturation():
    x = torch.tensor([[500.0] + [1.0] * 31])
    floor = mx.quantize_mx(x, scale_rule="floor")
    rceil = mx.quantize_mx(x, scale_rule="rceil")
    assert int(floor.scale) == 127 and floor.dequantize()[0, 0] == 448.0  # saturated
    assert int(rceil.scale) == 128 and rceil.dequantize()[0, 0] == 512.0  # 250 rounds to 256, times 2


def test_round_trip_error_on_gaussian():
    x = torch.randn(256, 1024, generator=torch.Generator().manual_seed(0))
    for rule in ("floor", "rceil"):
        t = mx.quantize_mx(x, scale_rule=rule)
        rel = ((t.dequantize() - x).abs() / x.abs()).mean().item()
        assert 0.01 < rel < 0.05, (rule, rel)
    e5 = mx.quantize_mx(x, elem="e5m2")
    assert (e5.dequantize() - x).norm() > (mx.quantize_mx(x).dequantize() - x).norm()


def test_dequantize_dtypes_and_float64_input():
    x = random_magnitudes((6, 64), 3, -5, 5, torch.float64)
    t = mx.quantize_mx(x)
    assert_matches_model(x.float(), "e4m3", "floor", -1)  # float64 values that are floats agree
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        d = t.dequantize(dtype)
        assert d.dtype == dtype
        torch.testing.assert_close(d.double(), t.dequantize(torch.float64).to(dtype).double(), rtol=0, atol=0)


def test_empty_and_short():
    t = mx.quantize_mx(torch.zeros(0, 40))
    assert t.data.shape == (0, 40) and t.scale.shape == (0, 2)
    t = mx.quantize_mx(torch.zeros(5, 0), axis=1)
    assert t.scale.shape == (5, 0)
    t = mx.quantize_mx(torch.tensor([3.0]))
    assert t.dequantize().item() == 3.0 and t.scale.shape == (1,)


def test_bad_input_raises():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="x must be"):
        mx.quantize_mx(torch.ones(4, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="x must be"):
        mx.quantize_mx(x.to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="block"):
        mx.quantize_mx(x, block=16)
    with pytest.raises(ValueError, match="elem"):
        mx.quantize_mx(x, elem="e2m1")
    with pytest.raises(ValueError, match="scale_rule"):
        mx.quantize_mx(x, scale_rule="ceil")
    with pytest.raises(ValueError, match="axis"):
        mx.quantize_mx(x, axis=2)
    with pytest.raises(ValueError, match="backend"):
        mx.quantize_mx(x, backend="triton")  # a CPU tensor, no interpreter
    with pytest.raises(ValueError, match="x must"):
        mx.quantize_mx(torch.tensor(1.0))
    a = mx.quantize_mx(x, axis=-1)
    b = mx.quantize_mx(torch.randn(64, 8), axis=0)
    with pytest.raises(ValueError, match="a must be quantized"):
        mx.mx_matmul(mx.quantize_mx(x, axis=0), b)
    with pytest.raises(ValueError, match="b must be quantized"):
        mx.mx_matmul(a, mx.quantize_mx(torch.randn(64, 8), axis=1))
    with pytest.raises(ValueError, match="disagree on K"):
        mx.mx_matmul(a, mx.quantize_mx(torch.randn(96, 8), axis=0))
    with pytest.raises(ValueError, match="MXTensor"):
        mx.mx_matmul(x, b)
    with pytest.raises(ValueError, match="out_dtype"):
        mx.mx_matmul(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="needs CUDA"):
        mx.mx_matmul(a, b, backend="dequant_mm")
    with pytest.raises(ValueError, match="scale_rule"):
        mx.MXLinear(4, 4, scale_rule="nearest")
    with pytest.raises(ValueError, match="in_features"):
        mx.MXLinear(4, 4)(torch.randn(2, 5))


# --------------------------------------------------------------------------- matmul
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize("M,K,N", [(17, 70, 9), (1, 32, 1), (64, 256, 48), (3, 5, 2)])
def test_mx_matmul_reference(M, K, N):
    g = torch.Generator().manual_seed(M * K * N)
    a = mx.quantize_mx(torch.randn(M, K, generator=g) * 3, elem="e4m3", axis=-1)
    b = mx.quantize_mx(torch.randn(K, N, generator=g), elem="e5m2", axis=0, scale_rule="rceil")
    want = a.dequantize(torch.float64) @ b.dequantize(torch.float64)
    got = mx.mx_matmul(a, b, out_dtype=torch.float32)
    assert got.shape == (M, N) and got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-4
    assert torch.equal(mx.mx_matmul(a, b, out_dtype=torch.float32, backend="exact"), got)  # the exact path
    assert mx.mx_matmul(a, b).dtype == torch.bfloat16
    # a transposed view is blocked along the other axis: (K, M) blocked along K, transposed
    at = mx.quantize_mx(torch.randn(K, M, generator=g), axis=0).t()
    assert at.axis == 1 and at.data.shape == (M, K)
    assert rel_err(mx.mx_matmul(at, b, out_dtype=torch.float32),
                   at.dequantize(torch.float64) @ b.dequantize(torch.float64)) <= 1e-4


# --------------------------------------------------------------------------- MXLinear
def _mx_exact_linear(x, w, dy, cfg):
    """Forward and both gradients composed from quantize_mx and float64 products."""
    q = lambda t, elem, axis: mx.quantize_mx(t, elem=elem, axis=axis, scale_rule=cfg.scale_rule).dequantize(torch.float64)
    out = q(x, cfg.elem, 1) @ q(w, cfg.elem, 1).t()
    dx = q(dy, cfg.grad_elem, 1) @ q(w, cfg.elem, 0)
    dw = q(dy, cfg.grad_elem, 0).t() @ q(x, cfg.elem, 0)
    return out, dx, dw


@pytest.mark.parametrize("M", [0, 1, 45, 130])
@pytest.mark.parametrize("grad_elem,scale_rule", [("e4m3", "rceil"), ("e5m2", "floor")])
def test_mxlinear_forward_backward(M, grad_elem, scale_rule):
    torch.manual_seed(M)
    ref = nn.Linear(70, 40)
    lin = mx.MXLinear.from_linear(ref, grad_elem=grad_elem, scale_rule=scale_rule)
    assert lin.weight is ref.weight
    x = torch.randn(M, 70, requires_grad=True)
    y = lin(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    out, dx, dw = _mx_exact_linear(x.detach(), lin.weight.detach(), dy, lin.mx_config)
    assert y.shape == (M, 40) and y.dtype == torch.float32
    if M == 0:
        assert x.grad.shape == x.shape and float(lin.weight.grad.abs().sum()) == 0.0
        return
    assert rel_err(y - lin.bias, out) <= 1e-5
    assert rel_err(x.grad, dx) <= 1e-5
    assert rel_err(lin.weight.grad, dw) <= 1e-5
    torch.testing.assert_close(lin.bias.grad, dy.sum(0))
    # against plain nn.Linear: within MX quantization error
    x2 = x.detach().clone().requires_grad_()
    w2 = ref.weight.detach().clone().requires_grad_()
    y2 = nn.functional.linear(x2, w2, ref.bias.detach())
    y2.backward(dy)
    tol = 0.08 if grad_elem == "e4m3" else 0.15
    assert rel_err(y, y2) < 0.08 and rel_err(x.grad, x2.grad) < tol and rel_err(lin.weight.grad, w2.grad) < tol


def test_mxlinear_autocast_nd_and_training_step():
    torch.manual_seed(0)
    lin = mx.MXLinear(64, 32, bias=False)
    x = torch.randn(2, 3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    y.float().square().mean().backward()
    assert lin.weight.grad.dtype == torch.float32 and lin.weight.grad.abs().sum() > 0
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    before = lin.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, lin.weight)


def test_convert_to_mx():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4)))
    params = {name: p for name, p in model.named_parameters()}
    out = mx.convert_to_mx(model, filter_fn=lambda m, fqn: fqn != "2.1", elem="e5m2")
    assert out is model
    assert isinstance(model[0], mx.MXLinear) and isinstance(model[2][0], mx.MXLinear)
    assert type(model[2][1]) is nn.Linear
    assert model[0].mx_config.elem == "e5m2"
    assert all(p is params[name] for name, p in model.named_parameters())  # same Parameter objects
    assert model(torch.randn(3, 8)).shape == (3, 4)
    mx.convert_to_mx(model)  # idempotent on MXLinear, converts the rest
    assert isinstance(model[2][1], mx.MXLinear) and model[0].mx_config.elem == "e5m2"
    assert isinstance(mx.convert_to_mx(nn.Linear(4, 4)), mx.MXLinear)
    with pytest.raises(ValueError, match="elem"):
        mx.convert_to_mx(nn.Sequential(nn.Linear(4, 4)), elem="fp4")


# --------------------------------------------------------------------------- plugin and training
def _tiny_setup(seed=0):
    from gemcore.config import AttentionConfig, ModelConfig
    from gemcore.data import make_synthetic
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel

    cfg = ModelConfig(num_items=200, hidden=32, num_blocks=1, num_heads=2, mlp_ratio=2, moe_experts=2,
                      moe_top_k=1)
    data = make_synthetic(num_users=256, num_items=200, num_actions=4, max_len=12, num_candidates=2,
                          num_clusters=8, kind="uniform", seed=seed)
    torch.manual_seed(seed)
    model = GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))
    return model, data


def test_plugin_registers_and_converts():
    from gemcore.config import PrecisionConfig
    from gemcore.plugin_manager import create_plugin_manager

    impl = create_plugin_manager().resolve("precision", "mxfp8")
    policy = impl.factory(PrecisionConfig(impl="mxfp8"))
    assert policy.name == "mxfp8" and policy.compute_dtype == torch.bfloat16
    model, data = _tiny_setup()
    model = policy.apply(model)
    converted = {n for n, m in model.named_modules() if isinstance(m, mx.MXLinear)}
    assert converted == set(policy.converted)
    assert "blocks.0.qkv" in converted and "blocks.0.mlp.experts.0.gate_up" in converted
    assert not any("router" in n or n.startswith("head") for n in converted)
    assert isinstance(model.item_emb, nn.Embedding)
    with policy.autocast("cpu"):
        loss = model.loss(data.__getitems__(list(range(8))))
    loss.backward()
    assert math.isfinite(loss.item())
    small = impl.factory(type("C", (), {"mx_min_features": 100, "mx_keep": "head"})())
    assert small.apply(_tiny_setup()[0]) is not None and small.converted == []
    with pytest.raises(ValueError, match="mx_min_features"):
        impl.factory(type("C", (), {"mx_min_features": -1})())


def _train(policy, steps=30, seed=0) -> list[float]:
    model, data = _tiny_setup(seed)
    model = policy.apply(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = np.random.default_rng(seed)
    losses = []
    for _ in range(steps):
        batch = data.__getitems__(g.choice(len(data), 16, replace=False).tolist())
        with policy.autocast("cpu"):
            loss = model.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_loss_parity():
    from gemcore.precision import AutocastPolicy
    from gemcore.precision.mx import MXPrecisionPolicy

    bf16 = _train(AutocastPolicy("bf16", torch.bfloat16))
    mxfp8 = _train(MXPrecisionPolicy())
    tail_bf16, tail_mx = np.mean(bf16[-10:]), np.mean(mxfp8[-10:])
    assert tail_bf16 < np.mean(bf16[:5])  # it learned something
    assert abs(tail_mx - tail_bf16) <= 0.02 * tail_bf16, (tail_mx, tail_bf16)


# --------------------------------------------------------------------------- Triton in the interpreter
@pytest.mark.slow
def test_triton_kernels_in_interpreter():
    """Runs test_mx_triton.py with TRITON_INTERPRET=1 (it must be set before triton is imported)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: test_mx_triton.py runs on it directly")
    env = dict(os.environ, TRITON_INTERPRET="1")
    here = Path(__file__).parent
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           str(here / "test_mx_triton.py")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


@pytest.mark.parametrize("style", ["colwise", "rowwise"])
def test_mxlinear_under_tensor_parallelism_equals_the_plain_layer(one_rank_group, style):
    """ColwiseParallel / RowwiseParallel on a one-rank mesh turn the weight into a DTensor
    (Shard(0) / Shard(1)); MXLinear then runs on the local shards and must give the plain layer's
    output and gradients bit for bit (the multi-rank parity is tests/test_planner_apply.py's)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(3)
    plain = mx.MXLinear(64, 96)
    split = mx.MXLinear(64, 96)
    split.load_state_dict(plain.state_dict())
    mesh = init_device_mesh("cpu", (1,))
    parallelize_module(split, mesh, ColwiseParallel() if style == "colwise" else RowwiseParallel())
    assert isinstance(split.weight, DTensor)
    x = torch.randn(5, 7, 64)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = plain(x1), split(x2)
    assert torch.equal(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    assert torch.equal(x2.grad, x1.grad)
    assert torch.equal(split.weight.grad.full_tensor(), plain.weight.grad)
    assert torch.equal(split.bias.grad.full_tensor(), plain.bias.grad)


def test_mxlinear_tensor_parallel_bad_layouts(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,))
    rowwise = parallelize_module(mx.MXLinear(32, 32), mesh, RowwiseParallel())
    with pytest.raises(ValueError, match="row-split weight"):
        rowwise._forward_tensor_parallel(torch.randn(4, 32), torch.float32)   # a plain input
    replicated = mx.MXLinear(32, 32, bias=False)
    replicated.weight = nn.Parameter(distribute_tensor(replicated.weight.detach(), mesh, [Replicate()]))
    with pytest.raises(ValueError, match="neither Shard"):
        replicated(torch.randn(4, 32))


def test_mx_policy_options_come_from_the_precision_config():
    from gemcore.config import PrecisionConfig
    from gemcore.precision.mx import MXPrecisionPolicy, make_mx_policy as make_policy

    default = PrecisionConfig()
    for policy in (MXPrecisionPolicy(), make_policy(PrecisionConfig(impl="mxfp8")), make_policy(object())):
        assert (policy.mx_config.elem, policy.mx_config.grad_elem, policy.mx_config.scale_rule) == \
            (default.mx_elem, default.mx_grad_elem, default.mx_scale_rule)
        assert (policy.min_features, list(policy.keep), policy.fsdp_all_gather) == \
            (default.mx_min_features, default.mx_keep, default.mx_fsdp_all_gather)
    chosen = make_policy(PrecisionConfig(impl="mxfp8", mx_scale_rule="floor", mx_keep=["head"], mx_min_features=64))
    assert (chosen.mx_config.scale_rule, chosen.keep, chosen.min_features) == ("floor", ("head",), 64)
