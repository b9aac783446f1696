"""Built-in precision policy ``fp8_block``: :mod:`gemcore.precision.fp8_block` (block-scaled FP8
linear layers)."""
from gemcore.hookspecs import hookimpl
from gemcore.precision.fp8_block import make_fp8_block_policy


@hookimpl
def gemcore_precision_policies():
    return {"fp8_block": make_fp8_block_policy}
