"""The ``fp8_block`` precision policy: DeepSeek-V3's block-scaled FP8 in every large ``nn.Linear``.

``apply(model)`` swaps ``nn.Linear`` layers for :class:`gemcore.kernels.fp8_block.FP8BlockLinear`
(same parameters, float32 master weights) except those named in ``fp8_keep`` (by default the
router of a mixture of experts and the click-through head). Everything else runs under bf16
autocast. ``fp8_matmul`` picks the GEMM backend (``auto``: the PyTorch reference on CPU; on CUDA
only a backend verified on that GPU generation, else an error asking for an explicit choice).
Launched on several ranks (FSDP2), the converted layers' weights are wrapped by
:func:`gemcore.kernels.fp8_block_fsdp.wrap_fp8_block_weights` so FSDP2 all-gathers them in FP8
(``fp8_fsdp_all_gather``, default on).
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from gemcore.hookspecs import hookimpl
from gemcore.kernels.fp8_block import FP8BlockConfig, FP8BlockLinear, convert_to_fp8_block
from gemcore.precision import AutocastPolicy

log = logging.getLogger(__name__)

DEFAULTS: dict[str, Any] = {
    "fp8_matmul": "auto",  # GEMM backend: auto | reference | cublas | scaled_mm | triton
    "fp8_keep": ("router", "head"),  # module-name components that stay in bf16
    "fp8_fsdp_all_gather": True,  # under FSDP2 (several ranks): all-gather the weights in FP8
}


def _launched_ranks() -> int:
    from gemcore.comms.launch import detect

    return detect().world_size


class FP8BlockPrecisionPolicy(AutocastPolicy):
    """bf16 autocast plus block-scaled FP8 linear layers. ``converted``: names of the layers swapped."""

    def __init__(self, matmul: str = "auto", keep: Sequence[str] = ("router", "head"),
                 fsdp_all_gather: bool = True):
        super().__init__("fp8_block", torch.bfloat16)
        self.fp8_config = FP8BlockConfig(matmul=matmul)
        if isinstance(keep, str):
            keep = [k for k in keep.split(",") if k]
        if not isinstance(fsdp_all_gather, bool):
            raise ValueError(f"fp8_fsdp_all_gather must be a bool, got {fsdp_all_gather!r}")
        self.keep = tuple(keep)
        self.fsdp_all_gather = fsdp_all_gather
        self.converted: list[str] = []
        self.fp8_gathered: list[str] = []  # layers whose weights FSDP2 will gather in FP8

    def wants(self, linear: nn.Linear, fqn: str) -> bool:
        """Whether the linear layer named ``fqn`` runs in FP8."""
        return not any(part in self.keep for part in fqn.split("."))

    def apply(self, model: nn.Module) -> nn.Module:
        model = convert_to_fp8_block(model, filter_fn=self.wants, matmul=self.fp8_config.matmul)
        self.converted = [name for name, m in model.named_modules() if isinstance(m, FP8BlockLinear)]
        log.info("fp8_block: %d linear layers in block-scaled FP8 (matmul=%s)", len(self.converted),
                 self.fp8_config.matmul)
        if self.fsdp_all_gather and _launched_ranks() > 1:
            from gemcore.kernels.fp8_block_fsdp import wrap_fp8_block_weights

            self.fp8_gathered = wrap_fp8_block_weights(model)
            log.info("fp8_block: %d weights all-gathered in FP8 under FSDP2", len(self.fp8_gathered))
        return model


def make_policy(config: Any) -> FP8BlockPrecisionPolicy:
    """``factory(config: PrecisionConfig)``: options from the config where present, else DEFAULTS."""
    opts = {key: getattr(config, key, default) for key, default in DEFAULTS.items()}
    return FP8BlockPrecisionPolicy(matmul=opts["fp8_matmul"], keep=opts["fp8_keep"],
                                   fsdp_all_gather=opts["fp8_fsdp_all_gather"])


@hookimpl
def gemcore_precision_policies():
    return {"fp8_block": make_policy}
