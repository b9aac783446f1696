"""Built-in precision policies: ``fp32`` and ``bf16`` (autocast, float32 master weights)."""
import torch

from gemcore.hookspecs import hookimpl
from gemcore.precision import AutocastPolicy, PrecisionPolicy


@hookimpl
def gemcore_precision_policies():
    return {
        "fp32": lambda config: PrecisionPolicy(),
        "bf16": lambda config: AutocastPolicy("bf16", torch.bfloat16),
    }
