"""gemcore collective layer (issue 5): one Communicator API over several backends.

```python
from gemcore import comms
c = comms.init(backend="auto")    # "auto" | "single" | "torch" | "mpi" | "ce" | a plugin's name
c.all_gather(t); c.reduce_scatter(t, op="sum"); c.all_reduce(t, op="avg")
c.all_to_all(t, in_splits, out_splits); c.broadcast(t, src=0); c.barrier(); c.split(ranks)
comms.finalize()
```

Built-in backends (offered to the ``communication`` hook point by ``gemcore.plugins.comms_backends``):
``single`` (world 1), ``torch`` (torch.distributed: NCCL/gloo), ``mpi`` (mpi4py) and ``ce``
(copy-engine collectives over CUDA IPC, CuPy). A backend's library is imported only when it is
selected, so the package imports without mpi4py or CuPy.
"""
from __future__ import annotations

import sys
import traceback
from typing import Any, Callable

from gemcore.comms.base import REDUCE_OPS, Communicator, CommsTimeout, MismatchError
from gemcore.comms.launch import LaunchInfo, detect

__all__ = ["init", "get", "finalize", "auto_backend", "BUILTIN_BACKENDS", "Communicator",
           "CommsTimeout", "MismatchError", "LaunchInfo", "detect", "REDUCE_OPS"]


def _single(**options: Any) -> Communicator:
    from gemcore.comms.single import SingleCommunicator
    return SingleCommunicator(**options)


def _torch(**options: Any) -> Communicator:
    from gemcore.comms.torch_backend import TorchCommunicator
    return TorchCommunicator(**options)


def _mpi(**options: Any) -> Communicator:
    from gemcore.comms.mpi_backend import MPICommunicator
    return MPICommunicator(**options)


def _ce(**options: Any) -> Communicator:
    from gemcore.comms.ce_backend import CopyEngineCommunicator
    return CopyEngineCommunicator(**options)


#: name -> factory(**options) -> Communicator; the built-in plugin offers exactly these
BUILTIN_BACKENDS: dict[str, Callable[..., Communicator]] = {
    "single": _single, "torch": _torch, "mpi": _mpi, "ce": _ce,
}

_current: Communicator | None = None
_previous_hook = None


def auto_backend(launch: LaunchInfo | None = None) -> str:
    """The backend ``"auto"`` picks: ``single`` for one process, ``torch`` under torchrun or when
    CUDA is present (NCCL), ``mpi`` under mpirun on CPU when mpi4py is installed, else ``torch``."""
    launch = launch or detect()
    if launch.world_size == 1 and launch.launcher == "none":
        return "single"
    if not launch.under_mpi:
        return "torch"
    import torch
    if torch.cuda.is_available():
        return "torch"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "torch"
    return "mpi"


def init(backend: str = "auto", *, manager=None, abort_on_error: bool = True, **options: Any) -> Communicator:
    """Create the job's communicator and make it current (see :func:`get`).

    :param backend: ``"auto"`` (:func:`auto_backend`), a built-in name or a name a plugin
        registered at the ``communication`` hook point.
    :param manager: a :class:`gemcore.plugin_manager.GemPluginManager` to resolve the name with
        (default: built-in names directly, other names through a freshly loaded manager).
    :param abort_on_error: with more than one rank, an unhandled exception prints it with this
        rank's number and aborts the whole job, so that no rank waits forever on a dead peer.
    :param options: passed to the backend's factory (``timeout_s``, ``check``, backend options).
    """
    global _current, _previous_hook
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"backend must be a backend name, got {backend!r}")
    if _current is not None:
        raise RuntimeError(f"comms.init: a communicator ({_current.backend}) is already initialised; "
                           f"call comms.finalize() first")
    name = auto_backend() if backend == "auto" else backend
    if manager is None and name in BUILTIN_BACKENDS:
        factory = BUILTIN_BACKENDS[name]
    else:
        if manager is None:
            from gemcore.plugin_manager import create_plugin_manager
            manager = create_plugin_manager()
        factory = manager.resolve("communication", name).factory
    comm = factory(**options)
    _current = comm
    if abort_on_error and comm.world_size > 1:
        _previous_hook = sys.excepthook
        sys.excepthook = _abort_hook
    return comm


def get() -> Communicator:
    """The communicator made by :func:`init`."""
    if _current is None:
        raise RuntimeError("comms.get: call comms.init() first")
    return _current


def finalize() -> None:
    """Release the current communicator (a no-op when none is initialised)."""
    global _current, _previous_hook
    comm, _current = _current, None
    if _previous_hook is not None:
        sys.excepthook, _previous_hook = _previous_hook, None
    if comm is not None:
        comm.finalize()


def _abort_hook(exc_type, exc, tb) -> None:
    comm = _current
    rank = comm.rank if comm is not None else "?"
    lines = traceback.format_exception(exc_type, exc, tb)
    text = "".join(lines).rstrip("\n").splitlines()
    sys.stderr.write(f"[rank {rank}] unhandled {exc_type.__name__}; aborting the job\n")
    sys.stderr.write("".join(f"[rank {rank}] {line}\n" for line in text))
    sys.stderr.flush()
    if comm is not None:
        comm.abort(1)
    sys.__excepthook__(exc_type, exc, tb)
