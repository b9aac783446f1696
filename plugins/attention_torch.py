"""Built-in attention ``varlen`` and ``flex``: PyTorch's own jagged attention
(:mod:`gemcore.kernels.torch_attention`), softmax only, for comparing against gemcore's kernels.

``varlen`` runs ``torch.nn.attention.varlen.varlen_attn`` (CUDA only; candidates also see the
earlier candidates of their sequence); ``flex`` runs compiled FlexAttention with gemcore's exact
mask. Both need ``attention.activation=softmax``.
"""
from gemcore.hookspecs import hookimpl
from gemcore.kernels.torch_attention import make_flex_attention, make_varlen_attention


@hookimpl
def gemcore_attention_impls():
    return {"varlen": make_varlen_attention, "flex": make_flex_attention}
