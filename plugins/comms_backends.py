"""Built-in collective backends ``single``, ``torch``, ``mpi`` and ``ce`` (communication hook point).

The factories import their libraries only when called, so this plugin loads without mpi4py or CuPy;
a backend whose library is missing raises a RuntimeError saying what to install when it is selected.
"""
from gemcore.comms import BUILTIN_BACKENDS
from gemcore.hookspecs import hookimpl


@hookimpl
def gemcore_comms_backends():
    return dict(BUILTIN_BACKENDS)
