"""MXFP8 (OCP Microscaling v1.0): cast, block-scaled GEMM, ``MXLinear`` and ``convert_to_mx``.

```python
from gemcore.kernels import mx
t = mx.quantize_mx(x, elem="e4m3", block=32, axis=-1, scale_rule="floor")
t.data, t.scale, t.dequantize()
y = mx.mx_matmul(a, b)              # a: (M, K) blocked along K, b: (K, N) blocked along K
model = mx.convert_to_mx(model)     # nn.Linear -> MXLinear, in place
```

The public functions check their inputs once and pick a backend: ``"reference"`` (PyTorch,
:mod:`mx_reference`, exact to the spec, any device) or the Triton kernels on CUDA
(:mod:`mx_triton`, :mod:`mx_gemm`). ``backend="auto"`` means Triton for CUDA tensors and the
reference otherwise; an explicitly requested backend that cannot run raises instead of being
replaced by another. Semantics: see :mod:`gemcore.kernels.mx_reference` and ``docs/mx.md``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from gemcore.kernels.mx_reference import (BLOCK, FORMATS, SCALE_RULES, dequantize_mx_reference,
                                          mx_matmul_reference, quantize_mx_reference)

ELEMS = tuple(FORMATS)
CAST_BACKENDS = ("auto", "triton", "reference")
#: "dequant_mm": Triton dequantize to bf16, then torch.mm (cuBLAS); "triton_scaled": ``tl.dot_scaled``
#: (Blackwell's block-scaled MMA; emulated by Triton elsewhere); "reference": PyTorch;
#: "exact": the exact path for the operands' device (dequant_mm on CUDA, reference elsewhere).
#: Exact paths are within 1e-4 of float64 of the dequantized operands; the block-scaled MMA path
#: (triton_scaled) within 1e-3 (docs/mx.md).
MATMUL_BACKENDS = ("auto", "exact", "dequant_mm", "triton_scaled", "reference")
EXACT_MATMULS = ("exact", "dequant_mm", "reference")
#: dgrad weight source: cast from the master weight, or recast from the forward's MX weight
DGRAD_WEIGHTS = ("master", "requant")
#: what "auto" runs for CUDA operands (the fastest exact path measured, see docs/mx.md), and on
#: data-centre Blackwell (compute capability 10.x). ``triton_scaled`` (Blackwell's native MX MMA)
#: becomes Blackwell's auto once it has run and passed there; until then auto stays exact
AUTO_CUDA_MATMUL = "dequant_mm"
AUTO_BLACKWELL_MATMUL = "dequant_mm"
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ELEM_DTYPES = {f.dtype: name for name, f in FORMATS.items()}


@dataclass
class MXTensor:
    """An MX-quantized tensor.

    ``data``: the elements (``torch.float8_e4m3fn`` or ``torch.float8_e5m2``), the source's shape.
    ``scale``: ``torch.uint8`` biased E8M0 exponents (byte = E + 127, 0xFF = NaN), the source's
    shape with ``axis`` ceil-divided by ``block``. ``axis`` is stored non-negative.
    """

    data: torch.Tensor
    scale: torch.Tensor
    elem: str
    block: int
    axis: int
    scale_rule: str

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Elements times their block's scale, in ``dtype`` (NaN for blocks with scale 0xFF)."""
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        return dequantize_mx_reference(self.data, self.scale, self.block, self.axis, dtype)

    def t(self) -> "MXTensor":
        """Transpose of a 2-D MX tensor (views of data and scale; the blocked axis moves too)."""
        if self.data.dim() != 2:
            raise ValueError(f"t() needs a 2-D MXTensor, got shape {tuple(self.data.shape)}")
        return MXTensor(self.data.t(), self.scale.t(), self.elem, self.block, 1 - self.axis,
                        self.scale_rule)


# --------------------------------------------------------------------------- validation
def _check_cast_args(x, elem, block, axis, scale_rule, backend, name="x") -> int:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.dtype.is_floating_point or x.dtype in _ELEM_DTYPES:
        raise ValueError(f"{name} must be a float16/bfloat16/float32/float64 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if elem not in FORMATS:
        raise ValueError(f"elem must be one of {ELEMS}, got {elem!r}")
    if block != BLOCK or isinstance(block, bool):
        raise ValueError(f"block must be {BLOCK} (OCP MX), got {block!r}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
    if not isinstance(axis, int) or not -x.dim() <= axis < x.dim():
        raise ValueError(f"axis must be an int in [{-x.dim()}, {x.dim()}), got {axis!r}")
    if backend not in CAST_BACKENDS:
        raise ValueError(f"backend must be one of {CAST_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if x.is_cuda and x.dtype in _TRITON_DTYPES else "reference"
    if backend == "triton" and not (x.is_cuda or _interpreting()):
        raise ValueError(f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), {name} is on {x.device}")
    if backend == "triton" and x.dtype not in _TRITON_DTYPES:
        raise ValueError(f"backend='triton' casts float16/bfloat16/float32, {name} is {x.dtype}")
    return backend


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------- cast
def quantize_mx(x: torch.Tensor, *, elem: str = "e4m3", block: int = BLOCK, axis: int = -1,
                scale_rule: str = "floor", backend: str = "auto") -> MXTensor:
    """MX-quantize ``x`` in blocks of ``block`` consecutive elements along ``axis``.

    elem: ``"e4m3"`` | ``"e5m2"``; scale_rule: ``"floor"`` (the spec) | ``"rceil"``.
    """
    backend = _check_cast_args(x, elem, block, axis, scale_rule, backend)
    axis = axis % x.dim()
    if backend == "triton":
        from gemcore.kernels.mx_triton import quantize_mx_triton

        data, scale = quantize_mx_triton(x, elem, block, axis, scale_rule)
    else:
        data, scale = quantize_mx_reference(x, elem, block, axis, scale_rule)
    return MXTensor(data, scale, elem, block, axis, scale_rule)


def quantize_mx_both(x: torch.Tensor, *, elem: str = "e4m3", scale_rule: str = "floor",
                     backend: str = "auto") -> tuple[MXTensor, MXTensor]:
    """2-D ``x`` (R, C) cast along both axes: (blocked along C, blocked along R).

    On CUDA one kernel reads ``x`` once and writes both (what training needs: activations and
    gradients are multiplied along K in one GEMM and along tokens in another).
    """
    backend = _check_cast_args(x, elem, BLOCK, -1, scale_rule, backend)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D, got shape {tuple(x.shape)}")
    if backend == "triton":
        from gemcore.kernels.mx_triton import quantize_mx_both_triton

        (rd, rs), (cd, cs) = quantize_mx_both_triton(x, elem, scale_rule)
    else:
        rd, rs = quantize_mx_reference(x, elem, BLOCK, 1, scale_rule)
        cd, cs = quantize_mx_reference(x, elem, BLOCK, 0, scale_rule)
    return (MXTensor(rd, rs, elem, BLOCK, 1, scale_rule), MXTensor(cd, cs, elem, BLOCK, 0, scale_rule))


# --------------------------------------------------------------------------- GEMM
def _check_mx_operand(t, name: str, axis: int) -> None:
    if not isinstance(t, MXTensor):
        raise ValueError(f"{name} must be an MXTensor, got {type(t).__name__}")
    if t.data.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.data.shape)}")
    if t.axis != axis:
        want = "axis=-1 (blocked along K of (M, K))" if name == "a" else "axis=0 (blocked along K of (K, N))"
        raise ValueError(f"{name} must be quantized with {want}, got axis={t.axis}")
    if t.block != BLOCK:
        raise ValueError(f"{name}.block must be {BLOCK}, got {t.block}")


def _mm_bf16(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """bf16 GEMM with float32 accumulation (cuBLAS), output in ``out_dtype``."""
    if out_dtype == torch.float32:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError):
            return torch.mm(a.float(), b.float())
    return torch.mm(a, b).to(out_dtype)


def mx_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype = torch.bfloat16,
              backend: str = "auto") -> torch.Tensor:
    """``a.dequantize() @ b.dequantize()`` with float32 accumulation, in ``out_dtype``.

    a: (M, K) quantized along K (axis=-1); b: (K, N) quantized along K (axis=0). -> (M, N).
    """
    _check_mx_operand(a, "a", 1)
    _check_mx_operand(b, "b", 0)
    if a.data.shape[1] != b.data.shape[0]:
        raise ValueError(f"a and b disagree on K: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}")
    if a.device != b.device:
        raise ValueError(f"a and b must be on one device, got {a.device} and {b.device}")
    if not isinstance(out_dtype, torch.dtype) or not out_dtype.is_floating_point:
        raise ValueError(f"out_dtype must be a floating torch.dtype, got {out_dtype!r}")
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"backend must be one of {MATMUL_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = _auto_matmul(a.data)
    if backend == "exact":
        backend = "dequant_mm" if a.data.is_cuda else "reference"
    if backend != "reference" and not (a.data.is_cuda or _interpreting()):
        raise ValueError(f"backend={backend!r} needs CUDA operands, got {a.device}")
    if backend == "reference":
        return mx_matmul_reference(a.data, a.scale, b.data, b.scale, BLOCK, out_dtype)
    if backend == "dequant_mm":
        from gemcore.kernels.mx_triton import dequantize_mx_triton

        a_bf = dequantize_mx_triton(a.data, a.scale, 1, torch.bfloat16)
        b_bf = dequantize_mx_triton(b.data, b.scale, 0, torch.bfloat16)
        return _mm_bf16(a_bf, b_bf, out_dtype)
    from gemcore.kernels.mx_gemm import mx_matmul_triton

    return mx_matmul_triton(a.data, a.scale, b.data, b.scale, out_dtype)


def _auto_matmul(data: torch.Tensor) -> str:
    """What backend="auto" runs for operands on data's device."""
    if not data.is_cuda:
        return "reference"
    return AUTO_BLACKWELL_MATMUL if _cuda_major(data.device) == 10 else AUTO_CUDA_MATMUL


@functools.lru_cache(maxsize=None)
def _cuda_major(device: torch.device) -> int:
    """A CUDA device's compute-capability major, asked of the driver once (MXLinear's three GEMMs
    ask it every step)."""
    return torch.cuda.get_device_capability(device)[0]


# --------------------------------------------------------------------------- MXLinear
@dataclass(frozen=True)
class MXConfig:
    """How an :class:`MXLinear` quantizes: ``elem`` for activations and weights, ``grad_elem``
    for output gradients, one ``scale_rule`` for all, and the GEMM/cast backends.

    ``dgrad_weight``: where the dgrad GEMM's weight (blocked along out_features) comes from:
    ``"master"`` casts the high-precision weight; ``"requant"`` recasts the forward's MX weight
    (blocked along in_features), dequantized exactly. The FSDP2 MX all-gather
    (:mod:`gemcore.kernels.mx_fsdp`) only has the forward's MX weight, so it always requantizes;
    ``"requant"`` gives an unsharded layer the same numbers.
    """

    elem: str = "e4m3"
    grad_elem: str = "e4m3"
    scale_rule: str = "rceil"
    cast_backend: str = "auto"
    matmul_backend: str = "auto"
    dgrad_weight: str = "master"

    def __post_init__(self):
        for key in ("elem", "grad_elem"):
            if getattr(self, key) not in FORMATS:
                raise ValueError(f"{key} must be one of {ELEMS}, got {getattr(self, key)!r}")
        if self.scale_rule not in SCALE_RULES:
            raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {self.scale_rule!r}")
        if self.cast_backend not in CAST_BACKENDS:
            raise ValueError(f"cast_backend must be one of {CAST_BACKENDS}, got {self.cast_backend!r}")
        if self.matmul_backend not in MATMUL_BACKENDS:
            raise ValueError(f"matmul_backend must be one of {MATMUL_BACKENDS}, got {self.matmul_backend!r}")
        if self.dgrad_weight not in DGRAD_WEIGHTS:
            raise ValueError(f"dgrad_weight must be one of {DGRAD_WEIGHTS}, got {self.dgrad_weight!r}")


def _weight_casts(weight: torch.Tensor, cfg: MXConfig) -> tuple[MXTensor, Optional[MXTensor]]:
    """(W blocked along K, W blocked along N or None: recast in backward) for the forward.

    A weight FSDP2 gathered in MX form (``MXGatheredWeight``) is used as gathered (no cast); an
    ``MXShardedWeight`` outside FSDP2 is cast from the master values it wraps.
    """
    from gemcore.kernels.mx_fsdp import MXGatheredWeight, MXShardedWeight

    if isinstance(weight, MXGatheredWeight):
        w_k = weight.mx
        if (w_k.elem, w_k.scale_rule) != (cfg.elem, cfg.scale_rule):
            raise ValueError(f"weight was gathered as {w_k.elem}/{w_k.scale_rule}, but the layer casts "
                             f"{cfg.elem}/{cfg.scale_rule}: wrap the weights after configuring the layer")
        return w_k, None
    if isinstance(weight, MXShardedWeight):
        weight = weight.master
    weight = weight.detach()
    cast = dict(scale_rule=cfg.scale_rule, backend=cfg.cast_backend)
    if cfg.dgrad_weight == "requant":
        return quantize_mx(weight, elem=cfg.elem, axis=-1, **cast), None
    return quantize_mx_both(weight, elem=cfg.elem, **cast)


def _requantize_along_n(w_k: MXTensor, cfg: MXConfig) -> MXTensor:
    """W (N, K) blocked along K -> blocked along N, cast from its dequantized values (exact in
    float32), not from the master weight."""
    if w_k.data.is_cuda and cfg.cast_backend != "reference":
        from gemcore.kernels.mx_triton import dequantize_mx_triton

        values = dequantize_mx_triton(w_k.data, w_k.scale, 1, torch.float32)
    else:
        values = w_k.dequantize(torch.float32)
    return quantize_mx(values, elem=w_k.elem, axis=0, scale_rule=cfg.scale_rule, backend=cfg.cast_backend)


class _MXLinearFunction(torch.autograd.Function):
    """out = x W^T with x, W and dy MX-quantized in each GEMM's K direction.

    forward: x (M, K) and W (N, K) along K. dgrad dx = dy W: dy along N, W along N.
    wgrad dW = dy^T x: dy and x along M. x and W are cast in both directions in one pass and the
    token/N-blocked copies (1 byte an element) are what is saved for backward. With
    ``dgrad_weight="requant"`` (and for weights FSDP2 gathered in MX) the K-blocked W is saved
    instead and recast along N in backward.
    """

    @staticmethod
    def forward(ctx, x, weight, cfg: MXConfig, out_dtype: torch.dtype):
        x_k, x_m = quantize_mx_both(x, elem=cfg.elem, scale_rule=cfg.scale_rule, backend=cfg.cast_backend)
        w_k, w_n = _weight_casts(weight, cfg)
        out = mx_matmul(x_k, w_k.t(), out_dtype=out_dtype, backend=cfg.matmul_backend)
        w_saved = w_n if w_n is not None else w_k
        ctx.save_for_backward(x_m.data, x_m.scale, w_saved.data, w_saved.scale)
        ctx.cfg, ctx.x_dtype, ctx.w_dtype, ctx.w_axis = cfg, x.dtype, weight.dtype, w_saved.axis
        return out

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        xd, xs, wd, ws = ctx.saved_tensors
        x_m = MXTensor(xd, xs, cfg.elem, BLOCK, 0, cfg.scale_rule)
        w_n = MXTensor(wd, ws, cfg.elem, BLOCK, ctx.w_axis, cfg.scale_rule)
        if ctx.w_axis == 1 and ctx.needs_input_grad[0]:
            w_n = _requantize_along_n(w_n, cfg)
        dy_n, dy_m = quantize_mx_both(dy.contiguous(), elem=cfg.grad_elem, scale_rule=cfg.scale_rule,
                                      backend=cfg.cast_backend)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = mx_matmul(dy_n, w_n, out_dtype=ctx.x_dtype, backend=cfg.matmul_backend)
        if ctx.needs_input_grad[1]:
            dw = mx_matmul(dy_m.t(), x_m, out_dtype=ctx.w_dtype, backend=cfg.matmul_backend)
        return dx, dw, None, None


def _is_dtensor(t) -> bool:
    """Whether t is a torch DTensor (a weight under tensor parallelism)."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


class MXLinear(nn.Linear):
    """Drop-in ``nn.Linear`` whose three GEMMs (forward, dgrad, wgrad) run in MX.

    Master weights and bias stay in their own dtype (float32 in training); each forward casts
    them. Output dtype: the autocast dtype when autocast is on for the input's device, else the
    input's dtype. Extra keyword arguments: ``elem``, ``grad_elem``, ``scale_rule``,
    ``cast_backend``, ``matmul_backend``, ``dgrad_weight`` (see :class:`MXConfig`). Under FSDP2
    with :func:`gemcore.kernels.mx_fsdp.wrap_mx_weights` the weight arrives already in MX.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 **mx_options):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.mx_config = MXConfig(**mx_options)

    @classmethod
    def from_linear(cls, linear: nn.Linear, **mx_options) -> "MXLinear":
        """An MXLinear sharing ``linear``'s parameters (no copy; optimizer state stays valid)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight = linear.weight
        new.bias = linear.bias
        new.mx_config = MXConfig(**mx_options)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x: last dimension must be in_features={self.in_features}, got {tuple(x.shape)}")
        device_type = x.device.type
        if torch.is_autocast_enabled(device_type):
            out_dtype = torch.get_autocast_dtype(device_type)
        else:
            out_dtype = x.dtype
        if _is_dtensor(self.weight):
            return self._forward_tensor_parallel(x, out_dtype)
        lead = x.shape[:-1]
        with torch.autocast(device_type, enabled=False):
            out = _MXLinearFunction.apply(x.reshape(-1, self.in_features), self.weight, self.mx_config,
                                          out_dtype)
            if x.dim() != 2:
                out = out.reshape(*lead, self.out_features)
            if self.bias is not None:  # after the reshape: the output is no view (FSDP2 warns on views)
                out = out + self.bias.to(out_dtype)
        return out

    def _forward_tensor_parallel(self, x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """The forward under torch tensor parallelism (``ColwiseParallel`` / ``RowwiseParallel`` on
        a 1-D mesh): the three MX GEMMs run on the local shards, so each rank casts only its part.

        - colwise, weight ``Shard(0)`` (output features split): x arrives replicated; the output
          is split along its last dimension, and x's gradient is a partial sum (reduced by
          DTensor on the way back).
        - rowwise, weight ``Shard(1)`` (input features split): x arrives split along its last
          dimension; the output is a partial sum (``Partial``), the replicated bias added after
          DTensor reduces it.
        MX blocks run along each shard's own K (and N in dgrad): with splits on 32-element
        borders they are the unsplit layer's blocks.
        """
        from torch.distributed.tensor import DTensor, Partial, Shard

        weight = self.weight
        if weight.device_mesh.ndim != 1 or len(weight.placements) != 1:
            raise ValueError(f"MXLinear under tensor parallelism needs a 1-D mesh, got placements "
                             f"{weight.placements}")
        split = weight.placements[0]
        if split == Shard(0):
            x_local = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
            out_placement = Shard(x_local.dim() - 1)
        elif split == Shard(1):
            if not isinstance(x, DTensor):
                raise ValueError("MXLinear with a row-split weight (Shard(1)) needs its input as a DTensor "
                                 "split along the last dimension (RowwiseParallel's input layout)")
            x_local = x.to_local()
            out_placement = Partial()
        else:
            raise ValueError(f"MXLinear under tensor parallelism: weight placement {split} is neither "
                             "Shard(0) (ColwiseParallel) nor Shard(1) (RowwiseParallel)")
        lead, k_local = x_local.shape[:-1], x_local.shape[-1]
        with torch.autocast(x_local.device.type, enabled=False):
            out = _MXLinearFunction.apply(x_local.reshape(-1, k_local), weight.to_local(), self.mx_config, out_dtype)
            out = out.reshape(*lead, out.shape[-1])
            if self.bias is not None and split == Shard(0):
                out = out + self.bias.to_local().to(out_dtype)
            out = DTensor.from_local(out, weight.device_mesh, [out_placement], run_check=False)
            if self.bias is not None and split == Shard(1):
                out = out + self.bias.to(out_dtype)
        return out

    def extra_repr(self) -> str:
        c = self.mx_config
        return f"{super().extra_repr()}, elem={c.elem}, grad_elem={c.grad_elem}, scale_rule={c.scale_rule}"


def convert_to_mx(module: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                  **mx_options) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` for an :class:`MXLinear` sharing its parameters.

    ``filter_fn(linear, fqn) -> bool`` picks which layers convert (default: all). In place;
    returns ``module`` (or the new MXLinear when ``module`` itself is a converted Linear).
    """
    MXConfig(**mx_options)  # validate once, before touching the model
    if filter_fn is not None and not callable(filter_fn):
        raise ValueError(f"filter_fn must be callable or None, got {type(filter_fn).__name__}")

    def wanted(linear: nn.Module, fqn: str) -> bool:
        return (type(linear) is nn.Linear) and (filter_fn is None or filter_fn(linear, fqn))

    if wanted(module, ""):
        return MXLinear.from_linear(module, **mx_options)
    for fqn, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if wanted(child, child_fqn):
                setattr(parent, child_name, MXLinear.from_linear(child, **mx_options))
    return module


__all__ = ["MXTensor", "MXConfig", "MXLinear", "quantize_mx", "quantize_mx_both", "mx_matmul",
           "convert_to_mx", "ELEMS", "SCALE_RULES"]
