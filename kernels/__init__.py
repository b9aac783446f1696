"""gemcore compute kernels: every Triton kernel beside a PyTorch reference with the same signature."""
from gemcore.kernels.jagged_attention import jagged_attention

__all__ = ["jagged_attention"]
