"""Multi-rank tests of gemcore.comms: real jobs under mpirun (1, 2 and 3 ranks, oversubscribed) and
torchrun, each running the conformance suite (gemcore.comms.conformance) on every rank, plus the
fault cases (a rank that raises or dies must end the whole job, naming the rank, never hang)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
MPIRUN = BIN / "mpirun"
TORCHRUN = BIN / "torchrun"

try:
    import mpi4py  # noqa: F401
    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False

needs_mpirun = pytest.mark.skipif(not (MPIRUN.exists() and HAVE_MPI4PY),
                                  reason=f"needs mpi4py and {MPIRUN} (pip install 'gemcore[mpi]')")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason=f"needs {TORCHRUN}")
pytestmark = pytest.mark.mpi

SUITE = [sys.executable, "-m", "gemcore.comms.conformance"]
DTYPES = "float32,bfloat16,int64,bool"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", GEMCORE_DISABLE_PLUGINS="", PYTHONWARNINGS="ignore")
    env.pop("GEMCORE_COMMS_NODE", None)
    return env


def _mpirun(n: int, *args: str, timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [str(MPIRUN), "-n", str(n), "--oversubscribe", *SUITE, *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _torchrun(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", str(n), "--module",
           "gemcore.comms.conformance", *args]
    return subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _passed(proc: subprocess.CompletedProcess, n: int, backends: list[str]) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    for rank in range(n):
        for backend in backends:
            assert f"[rank {rank}] OK {backend} " in proc.stdout, f"rank {rank} {backend} did not pass\n{out[-6000:]}"


@needs_mpirun
@pytest.mark.parametrize("n", [1, 2, 3])
def test_suite_under_mpirun(n):
    """Both backends, every op, dtypes, roots, uneven splits, sub-communicators; at 3 ranks also
    64 MiB tensors and two simulated nodes (local_rank/local_size per node)."""
    args = ["--backend", "mpi,torch", "--dtypes", DTYPES] + (["--large", "--nodes", "2"] if n == 3 else [])
    _passed(_mpirun(n, *args), n, ["mpi", "torch"])


@needs_torchrun
def test_suite_under_torchrun():
    _passed(_torchrun(2, "--backend", "torch", "--dtypes", DTYPES), 2, ["torch"])


def _ends_naming_rank(proc: subprocess.CompletedProcess, elapsed: float, words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, f"the job exited 0 after a planted fault\n{out[-4000:]}"
    assert elapsed < 30, f"the job took {elapsed:.0f}s to end after the fault"
    assert words in out, f"no {words!r} in the output\n{out[-4000:]}"
    assert "fault not detected" not in out


@needs_mpirun
@pytest.mark.parametrize("backend,fault", [("mpi", "raise"), ("torch", "exit")])
def test_fault_ends_mpirun_job(backend, fault):
    start = time.monotonic()
    proc = _mpirun(2, "--backend", backend, "--fault", fault, timeout=60)
    # a raising rank names itself through comms' abort hook; for a dying one mpirun reports the exit
    words = "[rank 1] RuntimeError: planted fault" if fault == "raise" else "Exit code"
    _ends_naming_rank(proc, time.monotonic() - start, words)


@needs_torchrun
def test_fault_ends_torchrun_job():
    start = time.monotonic()
    proc = _torchrun(2, "--backend", "torch", "--fault", "raise", timeout=60)
    _ends_naming_rank(proc, time.monotonic() - start, "[rank 1] RuntimeError: planted fault")
