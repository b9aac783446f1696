"""Built-in attention ``auto`` (the default), ``jfa`` (softmax) and ``gdpa`` (generalized
activations): jagged attention through :func:`gemcore.kernels.jagged_attention`, Triton on CUDA and
the PyTorch reference elsewhere.
"""
from gemcore.hookspecs import hookimpl
from gemcore.kernels.jagged_attention import make_attention


def _auto(config):
    """``config.activation`` as the ``reference`` implementation takes it, on the run's device's
    fastest path: the Triton kernels for CUDA tensors, the PyTorch reference for any other (the
    same function, so a CPU run is the ``reference`` run bit for bit)."""
    return make_attention(config, backend="auto")


def _jfa(config):
    """Jagged Flash Attention: softmax whatever ``config.activation`` says."""
    return make_attention(config, backend="auto", activation="softmax")


def _gdpa(config):
    """Softmax-free attention with ``config.activation`` (silu, HSTU-style, when it says softmax)."""
    act = config.activation if config.activation != "softmax" else "silu"
    return make_attention(config, backend="auto", activation=act)


@hookimpl
def gemcore_attention_impls():
    return {"auto": _auto, "jfa": _jfa, "gdpa": _gdpa}
