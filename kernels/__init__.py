"""gemcore compute kernels: every Triton kernel beside a PyTorch reference with the same signature.

Each op is a module: ``from gemcore.kernels.jagged_attention import jagged_attention``,
``from gemcore.kernels.mx import MXLinear``."""
