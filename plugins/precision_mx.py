"""The ``mxfp8`` precision policy: MX (OCP Microscaling) GEMMs in every large ``nn.Linear``.

``apply(model)`` swaps ``nn.Linear`` layers for :class:`gemcore.kernels.mx.MXLinear` (same
parameters, float32 master weights) except those named in ``keep`` (by default the router of a
mixture of experts and the click-through head) and those narrower than ``min_features``.
Embeddings and norms are not linear layers and stay as they are. Everything else runs under bf16
autocast. On CPU the MX casts and GEMMs run through the PyTorch reference (exact, slow); on CUDA
through the Triton kernels.

Under FSDP2 (the run is launched on more than one rank) and with ``mx_fsdp_all_gather`` on (the
default), the MX layers' weights are wrapped by :func:`gemcore.kernels.mx_fsdp.wrap_mx_weights`:
FSDP2 then all-gathers them in MX (1 + 1/32 bytes an element instead of 2), cast once per step
from the master shards, and the layers recast their dgrad weight from the gathered one
(``dgrad_weight="requant"``). One-process runs are left as they were.

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
from gemcore.hookspecs import hookimpl
from gemcore.kernels.mx import MXConfig, MXLinear, convert_to_mx
from gemcore.precision import AutocastPolicy

log = logging.getLogger(__name__)

_DEFAULTS = PrecisionConfig()  #: the MX options' defaults
_OPTIONS = ("mx_elem", "mx_grad_elem", "mx_scale_rule", "mx_min_features", "mx_keep", "mx_fsdp_all_gather")


def _launched_ranks() -> int:
    from gemcore.comms.launch import detect

    return detect().world_size


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

    def apply(self, model: nn.Module) -> nn.Module:
        c = self.mx_config
        model = convert_to_mx(model, filter_fn=self.wants, elem=c.elem, grad_elem=c.grad_elem,
                              scale_rule=c.scale_rule)
        self.converted = [name for name, m in model.named_modules() if isinstance(m, MXLinear)]
        log.info("mxfp8: %d linear layers in MX (%s, grads %s, %s)", len(self.converted), c.elem,
                 c.grad_elem, c.scale_rule)
        if self.fsdp_all_gather and _launched_ranks() > 1:
            from gemcore.kernels.mx_fsdp import wrap_mx_weights

            for m in model.modules():
                if isinstance(m, MXLinear):
                    m.mx_config = dataclasses.replace(m.mx_config, dgrad_weight="requant")
            self.mx_gathered = wrap_mx_weights(model)
            log.info("mxfp8: %d weights all-gathered in MX under FSDP2", len(self.mx_gathered))
        return model


def make_policy(config: Any) -> MXPrecisionPolicy:
    """``factory(config: PrecisionConfig)``: options from the config where present, else the
    :class:`~gemcore.config.PrecisionConfig` defaults."""
    opts = {key: getattr(config, key, getattr(_DEFAULTS, key)) for key in _OPTIONS}
    return MXPrecisionPolicy(elem=opts["mx_elem"], grad_elem=opts["mx_grad_elem"],
                             scale_rule=opts["mx_scale_rule"], min_features=opts["mx_min_features"],
                             keep=opts["mx_keep"], fsdp_all_gather=opts["mx_fsdp_all_gather"])


@hookimpl
def gemcore_precision_policies():
    return {"mxfp8": make_policy}
