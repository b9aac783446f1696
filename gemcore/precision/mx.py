"""The ``mxfp8`` precision policy: MX (OCP Microscaling) GEMMs in every large ``nn.Linear``.

``apply(model, fsdp_size=1)`` swaps ``nn.Linear`` layers for :class:`gemcore.kernels.mx.MXLinear`
(same parameters, float32 master weights) except those named in ``keep`` (by default the router of
a mixture of experts and the click-through head) and those narrower than ``min_features``.
Embeddings and norms are not linear layers and stay as they are. Everything else runs under bf16
autocast. On CPU the MX casts and GEMMs run through the PyTorch reference (exact, slow); on CUDA
through the Triton kernels.

When FSDP2 will shard the weights (``fsdp_size > 1``, which the trainer takes from the
parallelism it built) and ``mx_fsdp_all_gather`` is on (the default), the MX layers' weights are
wrapped by :func:`gemcore.kernels.mx_fsdp.wrap_mx_weights`: FSDP2 then all-gathers them in MX
(1 + 1/32 bytes an element instead of 2), cast once per step from the master shards, and the
layers recast their dgrad weight from the gathered one (``dgrad_weight="requant"``). Unsharded
models are left as they were.

Options are read from the precision config (``mx_elem``, ``mx_grad_elem``, ``mx_scale_rule``,
``mx_min_features``, ``mx_keep``, ``mx_fsdp_all_gather``); their defaults are those of
:class:`gemcore.config.PrecisionConfig`, the one place they are written.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

import torch
from torch import nn

from gemcore.config import PrecisionConfig
from gemcore.kernels.mx import MXConfig, MXLinear, convert_to_mx
from gemcore.precision.base import AutocastPolicy, check_fsdp_size

log = logging.getLogger(__name__)

_DEFAULTS = PrecisionConfig()  #: the MX options' defaults
_OPTIONS = ("mx_elem", "mx_grad_elem", "mx_scale_rule", "mx_min_features", "mx_keep", "mx_fsdp_all_gather")


class MXPrecisionPolicy(AutocastPolicy):
    """bf16 autocast plus MX linear layers. ``converted``: names of the layers swapped by apply."""

    def __init__(self, elem: str = _DEFAULTS.mx_elem, grad_elem: str = _DEFAULTS.mx_grad_elem,
                 scale_rule: str = _DEFAULTS.mx_scale_rule, min_features: int = _DEFAULTS.mx_min_features,
                 keep: Sequence[str] = tuple(_DEFAULTS.mx_keep),
                 fsdp_all_gather: bool = _DEFAULTS.mx_fsdp_all_gather):
        super().__init__("mxfp8", torch.bfloat16)
        self.mx_config = MXConfig(elem=elem, grad_elem=grad_elem, scale_rule=scale_rule)
        if not isinstance(min_features, int) or min_features < 0:
            raise ValueError(f"mx_min_features must be a non-negative int, got {min_features!r}")
        if isinstance(keep, str):
            keep = [k for k in keep.split(",") if k]
        if not isinstance(fsdp_all_gather, bool):
            raise ValueError(f"mx_fsdp_all_gather must be a bool, got {fsdp_all_gather!r}")
        self.min_features = min_features
        self.keep = tuple(keep)
        self.fsdp_all_gather = fsdp_all_gather
        self.converted: list[str] = []
        self.mx_gathered: list[str] = []  # layers whose weights FSDP2 will gather in MX

    def wants(self, linear: nn.Linear, fqn: str) -> bool:
        """Whether the linear layer named ``fqn`` runs in MX."""
        if any(part in self.keep for part in fqn.split(".")):
            return False
        return min(linear.in_features, linear.out_features) >= self.min_features

    def apply(self, model: nn.Module, *, fsdp_size: int = 1) -> nn.Module:
        """Swap the wanted linear layers for MXLinear; with ``fsdp_size > 1`` (ranks FSDP2 will
        shard each weight over) and ``fsdp_all_gather``, wrap their weights for an MX all-gather."""
        check_fsdp_size(fsdp_size)
        c = self.mx_config
        model = convert_to_mx(model, filter_fn=self.wants, elem=c.elem, grad_elem=c.grad_elem,
                              scale_rule=c.scale_rule)
        self.converted = [name for name, m in model.named_modules() if isinstance(m, MXLinear)]
        log.info("mxfp8: %d linear layers in MX (%s, grads %s, %s)", len(self.converted), c.elem,
                 c.grad_elem, c.scale_rule)
        if self.fsdp_all_gather and fsdp_size > 1:
            from gemcore.kernels.mx_fsdp import wrap_mx_weights

            for m in model.modules():
                if isinstance(m, MXLinear):
                    m.mx_config = dataclasses.replace(m.mx_config, dgrad_weight="requant")
            self.mx_gathered = wrap_mx_weights(model)
            log.info("mxfp8: %d weights all-gathered in MX under FSDP2 (%d shards)",
                     len(self.mx_gathered), fsdp_size)
        return model


def make_mx_policy(config: Any) -> MXPrecisionPolicy:
    """``factory(config: PrecisionConfig)``: options from the config where present, else the
    :class:`~gemcore.config.PrecisionConfig` defaults."""
    opts = {key: getattr(config, key, getattr(_DEFAULTS, key)) for key in _OPTIONS}
    return MXPrecisionPolicy(elem=opts["mx_elem"], grad_elem=opts["mx_grad_elem"],
                             scale_rule=opts["mx_scale_rule"], min_features=opts["mx_min_features"],
                             keep=opts["mx_keep"], fsdp_all_gather=opts["mx_fsdp_all_gather"])
