"""Benchmarks behind ``gem bench NAME``: one module per benchmark, each with
``add_arguments(parser)`` and ``run(args) -> int``, reporting the anchor measured in the same run."""
