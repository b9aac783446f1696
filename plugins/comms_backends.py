"""Built-in collective backends ``single``, ``torch``, ``mpi`` and ``ce`` (communication hook point).

The factories import their libraries only when called, so this plugin loads without mpi4py or CuPy;
a backend whose library is missing raises a RuntimeError saying what to install when it is selected.
Each factory offered here carries ``unavailable() -> str | None`` (why it cannot run on this
machine), which ``gem info`` reports.
"""
from __future__ import annotations

import importlib.util

from gemcore.comms import BUILTIN_BACKENDS
from gemcore.hookspecs import hookimpl


def _missing_module(name: str, extra: str) -> str | None:
    return None if importlib.util.find_spec(name) else f"needs {name} (pip install 'gemcore[{extra}]')"


def _ce_unavailable() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if importlib.util.find_spec("cupy") is None:
        return "needs CuPy (pip install 'gemcore[gpu]')"
    return None


UNAVAILABLE = {
    "mpi": lambda: _missing_module("mpi4py", "mpi"),
    "ce": _ce_unavailable,
}


def _with_check(name: str, factory):
    def make(*args, **kwargs):
        return factory(*args, **kwargs)

    make.unavailable = UNAVAILABLE.get(name, lambda: None)
    make.__doc__ = getattr(factory, "__doc__", None)
    return make


@hookimpl
def gemcore_comms_backends():
    return {name: _with_check(name, factory) for name, factory in BUILTIN_BACKENDS.items()}
