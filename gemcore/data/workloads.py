"""The history-length laws and the benchmark workloads built on them, defined once.

Length laws, each of ``n`` histories up to ``max_len`` events (``history_lengths``):

* ``dense95``: uniform integers in ``[int(0.9 * max_len), max_len)``, the maximum excluded: nearly
  full histories (mean about 0.95 ``max_len``). The low end is at least 1; at ``max_len`` 1 every
  history has length 1.
* ``heavytail``: lognormal with median ``max_len / 16`` and sigma 1.2, truncated to an integer and
  clipped to ``[min(8, max_len), max_len]``: most histories short, a few at the maximum (mean about
  0.12 ``max_len`` at 4096).
* ``uniform``: uniform integers in ``[1, max_len]``, the maximum included.

Benchmark workloads (``workload_lengths``), all drawn from ``torch.Generator().manual_seed(0)``:

* ``dense95``: 256 sequences, ``dense95`` law, ``max_len`` 2048;
* ``heavytail``: 256 sequences, ``heavytail`` law, ``max_len`` 4096 (drawn after the ``dense95``
  batch from the same generator);
* ``cross``: 1152 query sequences of the ``uniform`` law up to 2048, each attending to 256 keys
  (a fresh generator);
* ``model``: the training benchmark's shape: 48 ``heavytail`` histories up to 4096 plus 16
  candidates each (a fresh generator), 8 heads.

``gem bench bbs`` and ``gem bench train`` use the same laws at the longest lengths of
:data:`WORKLOAD_MAX_LEN`.
"""
from __future__ import annotations

import math
from typing import Literal

import torch

LengthLaw = Literal["dense95", "heavytail", "uniform"]
LENGTH_LAWS: tuple[str, ...] = ("dense95", "heavytail", "uniform")
#: benchmark workload -> longest history of its law
WORKLOAD_MAX_LEN = {"dense95": 2048, "heavytail": 4096, "uniform": 2048}
#: the attention benchmark's workloads
ATTENTION_WORKLOADS: tuple[str, ...] = ("dense95", "heavytail", "cross", "model")
#: workload ``model``: users, longest history, candidates per user and heads (D = 128) of
#: ``gem bench train --workload heavytail --users 48`` (hidden 1024, 8 heads)
MODEL_SHAPE = dict(users=48, max_len=4096, candidates=16, heads=8)
CROSS_QUERIES, CROSS_KEYS = 1152, 256
BENCH_SEQUENCES = 256


def history_lengths(law: str, n: int, max_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) int64 history lengths of ``law`` (see the module docstring), each in ``[1, max_len]``.

    :raises ValueError: ``law`` is not one of :data:`LENGTH_LAWS`, ``n`` is negative or
        ``max_len`` below 1.
    """
    if law not in LENGTH_LAWS:
        raise ValueError(f"length law must be one of {', '.join(LENGTH_LAWS)}, got {law!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if law == "dense95":
        low = max(int(0.9 * max_len), 1)
        return torch.randint(low, max(max_len, low + 1), (n,), generator=generator)
    if law == "heavytail":
        x = torch.empty(n, dtype=torch.float32).log_normal_(math.log(max_len / 16), 1.2, generator=generator)
        return x.clamp(min(8, max_len), max_len).long()
    return torch.randint(1, max_len + 1, (n,), generator=generator)


def workload_lengths(workload: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(query lengths, key lengths or None for self-attention) of an attention benchmark workload."""
    if workload not in ATTENTION_WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(ATTENTION_WORKLOADS)}, got {workload!r}")
    gen = torch.Generator().manual_seed(0)
    if workload == "model":
        history = history_lengths("heavytail", MODEL_SHAPE["users"], MODEL_SHAPE["max_len"], gen)
        return history + MODEL_SHAPE["candidates"], None
    dense = history_lengths("dense95", BENCH_SEQUENCES, WORKLOAD_MAX_LEN["dense95"], gen)
    if workload == "dense95":
        return dense, None
    heavy = history_lengths("heavytail", BENCH_SEQUENCES, WORKLOAD_MAX_LEN["heavytail"], gen)
    if workload == "heavytail":
        return heavy, None
    gen = torch.Generator().manual_seed(0)
    queries = history_lengths("uniform", CROSS_QUERIES, WORKLOAD_MAX_LEN["uniform"], gen)
    return queries, torch.full((CROSS_QUERIES,), CROSS_KEYS, dtype=torch.long)
