"""``FP8BlockSwiGLU``: a SwiGLU MLP whose six GEMMs (two forward, four backward) run in block-scaled
FP8 and whose activation writes its output, and its gradient, straight into FP8.

```python
mlp = FP8BlockSwiGLU(gate_up, down, matmul="cublas")   # shares their parameters
y = mlp(x)   # x (T, hidden) -> (T, hidden) = down(silu(g) * u), g, u = gate_up(x).chunk(2, -1)
```

The same computation as two :class:`gemcore.kernels.fp8_block.FP8BlockLinear` layers around
``F.silu(g) * u``, with one difference in rounding: ``gate_up``'s output, the activation ``h``
and the gradients ``dh`` and ``d(gate_up)`` are bf16 whatever the input's dtype (each activation
value computed in float32 and rounded once, as ``torch.compile`` computes the unfused one). On
CUDA the activation and its gradient are :mod:`gemcore.kernels.fp8_swiglu_triton`'s fused kernels;
elsewhere the same values come from PyTorch operations and the reference cast.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gemcore.kernels.fp8_block import (BLOCK, BlockFP8, FP8BlockConfig, FP8BlockLinear, _cast_backend,
                                       _weight_pair, check_fp8_input, fp8_block_mm, quantize_act)


def swiglu_reference(gu: torch.Tensor) -> torch.Tensor:
    """h = silu(g) * u of ``gu`` (M, 2F): computed in float32, rounded once to bf16."""
    g, u = gu.float().chunk(2, dim=-1)
    return (F.silu(g) * u).to(torch.bfloat16)


def swiglu_backward_reference(dh: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """d(gu) (M, 2F) of h = silu(g) * u given dh (M, F): [dh (u silu'(g)), dh silu(g)], computed in
    float32 and rounded once to bf16."""
    g, u = gu.float().chunk(2, dim=-1)
    s = torch.sigmoid(g)
    d = dh.float()
    return torch.cat([d * (u * (s * (1 + g * (1 - s)))), d * (g * s)], dim=-1).to(torch.bfloat16)


def _swiglu_fp8(gu: torch.Tensor, dh: torch.Tensor | None, cast: str) -> tuple[BlockFP8, BlockFP8]:
    """(rows, cols) of h (``dh`` None) or of d(gu), as :func:`quantize_act` lays them out."""
    if _cast_backend(gu, cast, "gate_up's output") == "reference":
        value = swiglu_reference(gu) if dh is None else swiglu_backward_reference(dh, gu)
        return quantize_act(value, backend="reference")
    from gemcore.kernels.fp8_swiglu_triton import swiglu_cast_triton

    rows, rscale, cols, cscale = swiglu_cast_triton(gu, dh)
    return BlockFP8(rows, rscale, 1), BlockFP8(cols, cscale, 1)


class _FP8SwiGLUFunction(torch.autograd.Function):
    """y = down(silu(g) * u), g, u = gate_up(x) halves; six FP8 GEMMs (forward, dgrad and wgrad
    of each layer). Saved for backward: x's and h's FP8 in 128x1 blocks (1 byte an element),
    gate_up's bf16 output, and both weights' transposed FP8."""

    @staticmethod
    def forward(ctx, x, w_gate_up, w_down, cfg: FP8BlockConfig, out_dtype: torch.dtype):
        M, K = x.shape
        x_rows, x_cols = quantize_act(x, backend=cfg.cast)
        gu_w, gu_wt = _weight_pair(w_gate_up, cfg)
        d_w, d_wt = _weight_pair(w_down, cfg)
        two_f = w_gate_up.shape[0]
        gu = fp8_block_mm(x_rows, gu_w, torch.bfloat16, cfg.matmul)[:M, :two_f]
        h_rows, h_cols = _swiglu_fp8(gu, None, cfg.cast)
        y = fp8_block_mm(h_rows, d_w, out_dtype, cfg.matmul)[:M, :w_down.shape[0]]
        ctx.save_for_backward(x_cols.data, x_cols.scale, gu, h_cols.data, h_cols.scale, gu_wt.data,
                              gu_wt.scale, d_wt.data, d_wt.scale)
        ctx.cfg, ctx.dims = cfg, (M, K, two_f // 2, w_down.shape[0])
        ctx.dtypes = (x.dtype, w_gate_up.dtype, w_down.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        M, K, f, N = ctx.dims
        x_dtype, gu_dtype, d_dtype = ctx.dtypes
        xc_data, xc_scale, gu, hc_data, hc_scale, guwt_data, guwt_scale, dwt_data, dwt_scale = ctx.saved_tensors
        dy_rows, dy_cols = quantize_act(dy.contiguous(), backend=cfg.cast)
        dh = fp8_block_mm(dy_rows, BlockFP8(dwt_data, dwt_scale, BLOCK), torch.bfloat16, cfg.matmul)[:M, :f]
        dw_down = fp8_block_mm(dy_cols, BlockFP8(hc_data, hc_scale, 1), d_dtype, cfg.matmul)[:N, :f]
        dgu_rows, dgu_cols = _swiglu_fp8(gu, dh.contiguous(), cfg.cast)
        dx = fp8_block_mm(dgu_rows, BlockFP8(guwt_data, guwt_scale, BLOCK), x_dtype, cfg.matmul)[:M, :K]
        dw_gate_up = fp8_block_mm(dgu_cols, BlockFP8(xc_data, xc_scale, 1), gu_dtype, cfg.matmul)[:2 * f, :K]
        return dx, dw_gate_up.contiguous(), dw_down.contiguous(), None, None


class FP8BlockSwiGLU(nn.Module):
    """``down(silu(g) * u)`` with ``g, u = gate_up(x).chunk(2, -1)``, in block-scaled FP8 with the
    activation fused into its casts. ``gate_up``: (2F, hidden), ``down``: (out, F), no biases, F a
    multiple of 128. Keyword options as :class:`FP8BlockLinear`'s (``matmul``, ``cast``): they
    convert plain ``nn.Linear`` layers, and must agree with layers already in FP8; the module's
    ``fp8_config`` is its layers' (one config for both)."""

    def __init__(self, gate_up: nn.Linear, down: nn.Linear, **options) -> None:
        super().__init__()
        for name, layer in (("gate_up", gate_up), ("down", down)):
            if not isinstance(layer, nn.Linear) or layer.bias is not None:
                raise ValueError(f"{name} must be an nn.Linear without bias, got {layer!r}")
        if gate_up.out_features % (2 * BLOCK) or down.in_features != gate_up.out_features // 2:
            raise ValueError(f"gate_up's out_features must be 2F with F a multiple of {BLOCK} and down's "
                             f"in_features F, got gate_up {gate_up.out_features}, down {down.in_features}")
        wanted = FP8BlockConfig(**options)  # (checks the options)
        self.gate_up = gate_up if isinstance(gate_up, FP8BlockLinear) else FP8BlockLinear.from_linear(gate_up, **options)
        self.down = down if isinstance(down, FP8BlockLinear) else FP8BlockLinear.from_linear(down, **options)
        for name, layer in (("gate_up", self.gate_up), ("down", self.down)):
            if options and layer.fp8_config != wanted:
                raise ValueError(f"{name} is an FP8BlockLinear with {layer.fp8_config}, but the options ask for {wanted}")
        if self.gate_up.fp8_config != self.down.fp8_config:
            raise ValueError(f"gate_up and down must share one FP8BlockConfig, got {self.gate_up.fp8_config} "
                             f"and {self.down.fp8_config}")

    @property
    def fp8_config(self) -> FP8BlockConfig:
        """How both layers compute (the same config)."""
        return self.gate_up.fp8_config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = check_fp8_input(x, self.gate_up.in_features, [self.gate_up.weight, self.down.weight],
                                    "FP8BlockSwiGLU", "use precision.fp8_fused_mlp=false, or mxfp8 / bf16 "
                                    "for tp > 1 plans")
        device_type = x.device.type
        lead = x.shape[:-1]
        with torch.autocast(device_type, enabled=False):
            y = _FP8SwiGLUFunction.apply(x.reshape(-1, x.shape[-1]), self.gate_up.weight, self.down.weight,
                                         self.fp8_config, out_dtype)
        return y.reshape(*lead, self.down.out_features)

    def extra_repr(self) -> str:
        c = self.fp8_config
        return f"matmul={c.matmul}, cast={c.cast}"
