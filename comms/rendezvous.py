"""The job's torch.distributed store: one TCPStore per process, shared by everything that needs one.

Under torchrun (or any ``MASTER_ADDR``/``MASTER_PORT`` environment) rank 0 serves it at that address;
under mpirun without those variables rank 0 picks its address and a free port and tells the others
through MPI. Copy-engine delegates and the default process group meet on prefixes of the same store,
so they never compete for one port.
"""
from __future__ import annotations

import datetime
import os
import socket

import torch.distributed as dist

from gemcore.comms.launch import LaunchInfo, detect

_STORE: dict[str, object] = {}


def mpi_rendezvous() -> tuple[str, int]:
    """Rank 0's address and a free port of it, agreed through MPI."""
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise RuntimeError("a job under mpirun agrees on its rendezvous address through MPI: install "
                           "mpi4py (pip install 'gemcore[mpi]') or set MASTER_ADDR and "
                           f"MASTER_PORT ({exc})") from exc
    world = MPI.COMM_WORLD
    hosts = world.allgather(socket.gethostname())
    if world.rank == 0:
        addr = "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        found = (addr, port)
    else:
        found = None
    return world.bcast(found, root=0)


def job_store(launch: LaunchInfo | None = None, timeout_s: float | None = 300.0):
    """The job's TCPStore (made on first use; collective then: every rank must call it)."""
    if "store" in _STORE:
        return _STORE["store"]
    launch = launch or detect()
    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else 3600.0)
    if launch.launcher == "none":
        store = dist.HashStore()
    else:
        if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ:
            url = "env://"  # torchrun's agent may serve the store already: torch's rendezvous knows
        elif launch.under_mpi:
            addr, port = mpi_rendezvous()
            url = f"tcp://{addr}:{port}"
        else:
            raise RuntimeError(f"{launch.launcher} set RANK/WORLD_SIZE but not MASTER_ADDR/MASTER_PORT")
        store, _, _ = next(dist.rendezvous(url, launch.rank, launch.world_size, timeout=timeout))
    _STORE["store"] = store
    return store


def forget_store() -> None:
    """Drop the cached store (after the job's process groups are destroyed)."""
    _STORE.pop("store", None)
