"""Precision policies (hook point ``precision``): the interface and the built-in policies.

``base``: :class:`PrecisionPolicy`, :class:`AutocastPolicy` (fp32, bf16) and the CPU denormal
switch; ``mx``: the ``mxfp8`` policy (MX linear layers); ``fp8_block``: the ``fp8_block`` policy
(block-scaled FP8 linear layers). The plugins in ``gemcore.plugins.precision_*`` register them.
"""
from gemcore.precision.base import AutocastPolicy, PrecisionPolicy, denormals_flushed, flush_denormals

__all__ = ["AutocastPolicy", "PrecisionPolicy", "denormals_flushed", "flush_denormals"]
