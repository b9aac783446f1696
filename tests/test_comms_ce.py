"""The copy-engine backend on a GPU: several processes sharing the node's GPU(s) run the
conformance suite (every op against values computed locally; reductions through copy-engine pulls
and one local kernel), with the mpi backend as delegate, in every synchronisation mode, and on two simulated nodes
(hierarchical all_gather, all_to_all and broadcast) and on nodes of unequal size (hierarchical
broadcast, the rest through the delegate). Skipped without a CUDA GPU, CuPy or mpirun."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

MPIRUN = Path(sys.executable).parent / "mpirun"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy (the 'gpu' extra)"),
    pytest.mark.skipif(importlib.util.find_spec("mpi4py") is None, reason="needs mpi4py (the 'mpi' extra)"),
]


def _mpirun() -> str:
    if MPIRUN.exists():
        return str(MPIRUN)
    return "mpirun"


def _run(n: int, *args: str) -> None:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    cmd = [_mpirun(), "-n", str(n), "--oversubscribe", sys.executable, "-m", "gemcore.comms.conformance",
           "--backend", "ce", "--device", "cuda", "--option", "delegate=mpi", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in range(n):
        assert f"[rank {rank}] OK ce " in proc.stdout, out[-6000:]


@pytest.mark.parametrize("sync", ["flags", "event", "barrier"])
@pytest.mark.parametrize("n", [2, 3])
def test_ce_conformance_on_one_node(n, sync):
    """Every synchronisation: GPU counters (no host barrier), IPC events with one host barrier and
    two window slots, or two host barriers."""
    _run(n, "--option", f"sync={sync}", "--dtypes", "float32,bfloat16,int64,bool", *(["--large"] if n == 2 else []))


@pytest.mark.parametrize("sync", ["flags", "event"])
def test_ce_hierarchical_on_two_simulated_nodes(sync):
    """4 ranks on 2 simulated nodes: all_gather, all_to_all and broadcast composed of inter-node
    delegate and intra-node copy-engine steps."""
    _run(4, "--option", f"sync={sync}", "--nodes", "2", "--dtypes", "float32,bfloat16")


def test_ce_hierarchical_on_unequal_simulated_nodes():
    """3 ranks on nodes of 2 + 1: broadcast through one leader per node; all_gather and
    all_to_all fall back to the delegate."""
    _run(3, "--option", "sync=barrier", "--nodes", "2", "--dtypes", "float32,int64")
