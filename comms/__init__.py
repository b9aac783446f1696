"""gemcore collective layer: one Communicator API over several backends.

```python
from gemcore import comms
c = comms.init(backend="auto")    # "auto" | "single" | "torch" | "mpi" | "ce" | a plugin's name
c.all_gather(t); c.reduce_scatter(t, op="sum"); c.all_reduce(t, op="avg")
c.all_to_all(t, in_splits, out_splits); c.broadcast(t, src=0); c.barrier(); c.split(ranks)
comms.finalize()

comms.from_process_group(pg)                 # torch backend over an existing ProcessGroup (not owned)
comms.group_communicator(pg, parent=None)    # the ranks of pg on parent's backend (default: init()'s)
comms.current()                              # init()'s communicator, or None
from gemcore.comms.autograd import all_to_all  # all_to_all(c, t, in_splits, out_splits), differentiable
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

from gemcore.comms.base import DEFAULT_TIMEOUT_S, REDUCE_OPS, Communicator, CommsTimeout, MismatchError
from gemcore.comms.launch import LaunchInfo, detect

__all__ = ["init", "get", "current", "finalize", "auto_backend", "from_process_group",
           "group_communicator", "BUILTIN_BACKENDS", "Communicator", "CommsTimeout", "MismatchError",
           "LaunchInfo", "detect", "REDUCE_OPS"]


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


def from_process_group(group=None, *, timeout_s: float | None = DEFAULT_TIMEOUT_S,
                       check: bool = True) -> Communicator:
    """A ``torch``-backend communicator over an existing torch.distributed process group (None:
    the default group), e.g. one dimension of a DeviceMesh (``mesh["dp_shard"].get_group()``).

    Collective over ``group``. The communicator does not own the group: its ``finalize`` leaves
    the group (and the default group) to whoever made them. It is not made current (see :func:`get`).
    """
    from gemcore.comms.torch_backend import TorchCommunicator
    return TorchCommunicator.wrap(group, timeout_s=timeout_s, check=check)


def current() -> Communicator | None:
    """The communicator made by :func:`init`, or None when none is initialised."""
    return _current


def group_communicator(group, parent: Communicator | None = None, *,
                       check: bool | None = None) -> Communicator:
    """A communicator over the ranks of the process group ``group``, on ``parent``'s backend.

    :param group: a torch.distributed ProcessGroup this rank belongs to (None: the default group).
    :param parent: the job's communicator (default: the one :func:`init` made, if any). Its ranks
        must be numbered as torch.distributed numbers them (the same launcher started both).
    :param check: exchange call signatures (see :class:`Communicator`); None: the parent's
        setting, on without a parent. Every rank must pass the same.
    :return: with no parent, or a ``torch`` one: :func:`from_process_group` of ``group`` (collective
        over ``group``; the parent's ``timeout_s``); with another backend (``mpi``, ``ce``, a
        plugin's): ``parent.split`` to the group's ranks, collective over the whole parent, so every
        rank of the parent must call this (each with its own group) — the way to run, say, expert
        all-to-alls through MPI while FSDP talks through gloo.
    """
    import torch.distributed as dist

    if parent is None:
        parent = _current
    if parent is not None and not isinstance(parent, Communicator):
        raise ValueError(f"parent must be a gemcore.comms Communicator or None, got {type(parent).__name__}")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise ValueError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
    if check is None:
        check = True if parent is None else parent.check
    if parent is None or parent.backend == "torch":
        options = {} if parent is None else {"timeout_s": parent.timeout_s}
        return from_process_group(group, check=bool(check), **options)
    world_rank, world_size = dist.get_rank(), dist.get_world_size()
    if (parent.rank, parent.world_size) != (world_rank, world_size):
        raise ValueError(f"parent: {parent.backend} communicator is rank {parent.rank} of "
                         f"{parent.world_size}, torch.distributed rank {world_rank} of {world_size}: "
                         f"the parent must span the same ranks in the same order")
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    sub = parent.split(ranks)
    sub.check = bool(check)
    if (sub.rank, sub.world_size) != (dist.get_rank(group), dist.get_world_size(group)):
        raise RuntimeError(f"group_communicator: {parent.backend} split gave rank {sub.rank} of "
                           f"{sub.world_size}, the process group says {dist.get_rank(group)} of "
                           f"{dist.get_world_size(group)}")
    return sub


def _abort_hook(exc_type, exc, tb) -> None:
    comm = _current
    rank = comm.rank if comm is not None else "?"
    lines = traceback.format_exception(exc_type, exc, tb)
    text = "".join(lines).rstrip("\n").splitlines()
    # the process's own stderr: a hook installed later may capture sys.stderr around this one
    # (torch.distributed's init_process_group buffers it, and the abort below would lose the buffer)
    err = sys.__stderr__ or sys.stderr
    err.write(f"[rank {rank}] unhandled {exc_type.__name__}; aborting the job\n")
    err.write("".join(f"[rank {rank}] {line}\n" for line in text))
    err.flush()
    if comm is not None:
        comm.abort(1)
    sys.__excepthook__(exc_type, exc, tb)
