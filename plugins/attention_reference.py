"""Built-in attention ``reference``: plain PyTorch over jagged values + offsets, no padding."""
from gemcore.hookspecs import hookimpl
from gemcore.kernels.jagged_attention import make_attention


@hookimpl
def gemcore_attention_impls():
    return {"reference": lambda config: make_attention(config, backend="reference")}
