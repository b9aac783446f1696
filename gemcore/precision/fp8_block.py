"""The ``fp8_block`` precision policy: DeepSeek-V3's block-scaled FP8 in every large ``nn.Linear``.

``apply(model, fsdp_size=1)`` swaps ``nn.Linear`` layers for
:class:`gemcore.kernels.fp8_block.FP8BlockLinear` (same parameters, float32 master weights) except
those named in ``fp8_keep`` (by default the router of a mixture of experts and the click-through
head). Everything else runs under bf16 autocast. ``fp8_matmul`` picks the GEMM backend (``auto``:
the PyTorch reference on CPU; on CUDA only a backend verified on that GPU generation, else an error
asking for an explicit choice). When FSDP2 will shard the weights (``fsdp_size > 1``, which the
trainer takes from the parallelism it built), the converted layers' weights are wrapped by
:func:`gemcore.kernels.fp8_block_fsdp.wrap_fp8_block_weights` so FSDP2 all-gathers them in FP8
(``fp8_fsdp_all_gather``, default on). ``fp8_fused_mlp`` (default off) replaces each of the
model's SwiGLU MLPs whose layers were converted by a
:class:`gemcore.kernels.fp8_swiglu.FP8BlockSwiGLU`, whose activation writes FP8 directly (the
same parameters; intermediate activations in bf16).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from gemcore.kernels.fp8_block import FP8BlockConfig, FP8BlockLinear, convert_to_fp8_block
from gemcore.precision.base import AutocastPolicy, check_fsdp_size

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "fp8_matmul": "auto",  # GEMM backend: auto | reference | cublas | scaled_mm | triton
    "fp8_keep": ("router", "head"),  # module-name components that stay in bf16
    "fp8_fsdp_all_gather": True,  # under FSDP2 (weights sharded): all-gather the weights in FP8
    "fp8_fused_mlp": False,  # SwiGLU MLPs as FP8BlockSwiGLU: the activation fused with its FP8 casts
}


class FP8BlockPrecisionPolicy(AutocastPolicy):
    """bf16 autocast plus block-scaled FP8 linear layers. ``converted``: names of the layers swapped."""

    def __init__(self, matmul: str = "auto", keep: Sequence[str] = ("router", "head"),
                 fsdp_all_gather: bool = True, fused_mlp: bool = False):
        super().__init__("fp8_block", torch.bfloat16)
        self.fp8_config = FP8BlockConfig(matmul=matmul)
        if isinstance(keep, str):
            keep = [k for k in keep.split(",") if k]
        if not isinstance(fsdp_all_gather, bool):
            raise ValueError(f"fp8_fsdp_all_gather must be a bool, got {fsdp_all_gather!r}")
        if not isinstance(fused_mlp, bool):
            raise ValueError(f"fp8_fused_mlp must be a bool, got {fused_mlp!r}")
        self.fused_mlp = fused_mlp
        self.fused_mlps: list[str] = []  # MLPs replaced by FP8BlockSwiGLU
        self.keep = tuple(keep)
        self.fsdp_all_gather = fsdp_all_gather
        self.converted: list[str] = []
        self.fp8_gathered: list[str] = []  # layers whose weights FSDP2 will gather in FP8

    def wants(self, linear: nn.Linear, fqn: str) -> bool:
        """Whether the linear layer named ``fqn`` runs in FP8."""
        return not any(part in self.keep for part in fqn.split("."))

    def apply(self, model: nn.Module, *, fsdp_size: int = 1) -> nn.Module:
        """Swap the wanted linear layers for FP8BlockLinear; with ``fsdp_size > 1`` (ranks FSDP2
        will shard each weight over) and ``fsdp_all_gather``, wrap their weights for an FP8
        all-gather."""
        check_fsdp_size(fsdp_size)
        model = convert_to_fp8_block(model, filter_fn=self.wants, matmul=self.fp8_config.matmul)
        self.converted = [name for name, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
        if self.fused_mlp:
            self.fused_mlps = fuse_swiglu_mlps(model)
            log.info("fp8_block: %d SwiGLU MLPs fused with their FP8 casts", len(self.fused_mlps))
        log.info("fp8_block: %d linear layers in block-scaled FP8 (matmul=%s)", len(self.converted),
                 self.fp8_config.matmul)
        if self.fsdp_all_gather and fsdp_size > 1:
            from gemcore.kernels.fp8_block_fsdp import wrap_fp8_block_weights

            self.fp8_gathered = wrap_fp8_block_weights(model)
            log.info("fp8_block: %d weights all-gathered in FP8 under FSDP2 (%d shards)",
                     len(self.fp8_gathered), fsdp_size)
        return model


def make_fp8_block_policy(config: Any) -> FP8BlockPrecisionPolicy:
    """``factory(config: PrecisionConfig)``: options from the config where present, else DEFAULTS."""
    opts = {key: getattr(config, key, default) for key, default in DEFAULTS.items()}
    return FP8BlockPrecisionPolicy(matmul=opts["fp8_matmul"], keep=opts["fp8_keep"],
                                   fsdp_all_gather=opts["fp8_fsdp_all_gather"], fused_mlp=opts["fp8_fused_mlp"])


def fuse_swiglu_mlps(model: nn.Module) -> list[str]:
    """Replace each :class:`gemcore.model.MLP` of ``model`` whose two layers are FP8BlockLinear
    (and whose inner size is a multiple of 128) by an FP8BlockSwiGLU sharing its parameters and
    its layers' FP8 config; the names of those replaced. The others keep their FP8 layers and
    unfused activation."""
    from gemcore.kernels.fp8_block import BLOCK
    from gemcore.kernels.fp8_swiglu import FP8BlockSwiGLU
    from gemcore.model import MLP

    fused = []
    for fqn, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if (type(child) is MLP and isinstance(child.gate_up, FP8BlockLinear)
                    and isinstance(child.down, FP8BlockLinear) and child.down.in_features % BLOCK == 0):
                setattr(parent, child_name, FP8BlockSwiGLU(child.gate_up, child.down))
                fused.append(f"{fqn}.{child_name}" if fqn else child_name)
    return fused
