"""Built-in attention ``jfa`` (softmax) and ``gdpa`` (generalized activations): jagged attention
through :func:`gemcore.kernels.jagged_attention`, Triton on CUDA and the PyTorch reference elsewhere.
"""
from gemcore.hookspecs import hookimpl
from gemcore.kernels.jagged_attention import make_attention


def _jfa(config):
    """Jagged Flash Attention: softmax whatever ``config.activation`` says."""
    return make_attention(config, backend="auto", activation="softmax")


def _gdpa(config):
    """Softmax-free attention with ``config.activation`` (silu, HSTU-style, when it says softmax)."""
    act = config.activation if config.activation != "softmax" else "silu"
    return make_attention(config, backend="auto", activation=act)


@hookimpl
def gemcore_attention_impls():
    return {"jfa": _jfa, "gdpa": _gdpa}
