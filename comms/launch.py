"""Where this process sits in the job: rank, world size and local rank from the launcher's environment.

Recognised launchers, first match wins:

* ``torchrun`` (torch.distributed.elastic): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``LOCAL_WORLD_SIZE`` (``TORCHELASTIC_RUN_ID`` marks it), rendezvous at ``MASTER_ADDR:MASTER_PORT``.
* Open MPI's ``mpirun``/``mpiexec``: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``,
  ``OMPI_COMM_WORLD_LOCAL_RANK``, ``OMPI_COMM_WORLD_LOCAL_SIZE``.
* MPICH / Intel MPI (Hydra): ``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``.
* a plain ``RANK``/``WORLD_SIZE`` environment (any other torch.distributed launcher).
* nothing: a single process, world 1.

:func:`detect` reports what the launcher said; :func:`detect_placement` also fills in the local
rank and size where the launcher is silent (one node assumed), for code that must pick a GPU.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Literal, Mapping

Launcher = Literal["torchrun", "openmpi", "mpich", "env", "none"]


@dataclass(frozen=True)
class LaunchInfo:
    """This process's place in the job as the launcher describes it.

    ``local_rank`` / ``local_size`` are None when the launcher does not say; the communicator then
    derives them from the host names of the ranks.
    """

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int | None
    local_size: int | None

    @property
    def under_mpi(self) -> bool:
        """True when an MPI launcher started the job (MPI can be initialised for rendezvous)."""
        return self.launcher in ("openmpi", "mpich")


# launcher -> (rank, world size, local rank, local size) variable names
_VARIABLES: dict[str, tuple[str, str, str, str]] = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
}


def detect(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read the launcher's variables from ``environ`` (default ``os.environ``).

    :raises ValueError: a variable is present but not an integer, or the values are inconsistent
        (rank outside ``[0, world_size)``), naming the variable.
    """
    env = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        launcher: Launcher = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "openmpi"
    elif "PMI_RANK" in env and "PMI_SIZE" in env:
        launcher = "mpich"
    elif "RANK" in env and "WORLD_SIZE" in env:
        launcher = "env"
    else:
        return LaunchInfo("none", 0, 1, 0, 1)
    rank_var, size_var, local_var, local_size_var = _VARIABLES[launcher]
    rank = _int(env, rank_var)
    world = _int(env, size_var)
    local_rank = _int(env, local_var) if local_var in env else None
    local_size = _int(env, local_size_var) if local_size_var in env else None
    if world is None or world < 1:
        raise ValueError(f"{size_var}={env.get(size_var)!r}: the world size must be a positive integer")
    if rank is None or not 0 <= rank < world:
        raise ValueError(f"{rank_var}={env.get(rank_var)!r}: the rank must be in [0, {world})")
    if local_rank is not None and local_size is not None and not 0 <= local_rank < local_size:
        raise ValueError(f"{local_var}={local_rank} is outside [0, {local_size_var}={local_size})")
    return LaunchInfo(launcher, rank, world, local_rank, local_size)


def detect_placement(environ: Mapping[str, str] | None = None) -> LaunchInfo:
    """:func:`detect`, with ``local_rank`` and ``local_size`` always integers.

    Where the launcher gives no local rank (a plain ``RANK``/``WORLD_SIZE`` environment, or MPICH
    without ``MPI_LOCALRANKID``), the job is taken to run on one node: the local rank is the rank
    and the local size the world size.

    :raises ValueError: as :func:`detect`.
    """
    info = detect(environ)
    local_rank = info.rank if info.local_rank is None else info.local_rank
    local_size = info.world_size if info.local_size is None else info.local_size
    return dataclasses.replace(info, local_rank=local_rank, local_size=local_size)


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None
