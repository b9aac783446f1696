"""Multi-rank tests of gemcore.comms: real jobs under mpirun (1, 3 and 4 ranks, oversubscribed) and
torchrun, each running the conformance suite (gemcore.comms.conformance) on every rank, plus the
fault cases (a rank that raises or dies must end the whole job, naming the rank, never hang)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
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
@pytest.mark.parametrize("n", [1, 3, 4])
def test_suite_under_mpirun(n):
    """Both backends, every op, dtypes, roots, uneven splits, sub-communicators, at 1, an odd number
    and 4 ranks. At 3 ranks two simulated nodes of unequal size (2 + 1),
    at 4 ranks two nodes of 2 and 64 MiB tensors (local_rank/local_size per node checked)."""
    extra = {3: ["--nodes", "2"], 4: ["--large", "--nodes", "2"]}.get(n, [])
    args = ["--backend", "mpi,torch", "--dtypes", DTYPES, *extra]
    _passed(_mpirun(n, *args), n, ["mpi", "torch"])


@needs_torchrun
def test_suite_under_torchrun():
    _passed(_torchrun(2, "--backend", "torch", "--dtypes", DTYPES), 2, ["torch"])


def _fault_job(cmd: list[str], timeout: float = 90) -> tuple[int, str, float]:
    """Run a job that plants a fault; returns (exit code, output, seconds from the planted fault
    to the end of the job). Output is read as it comes, so start-up time (4 processes importing
    torch on 2 loaded cores) does not count against the 30 s the issue allows after the fault."""
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    planted: list[float] = []

    def read() -> None:
        for line in proc.stdout:
            if not planted and "planting fault" in line:
                planted.append(time.monotonic())
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    end = time.monotonic()
    reader.join(timeout=10)
    out = "".join(lines)
    assert planted, f"the fault was never planted (exit {code})\n{out[-4000:]}"
    return code, out, end - planted[0]


def _ends_naming_rank(code: int, out: str, after_fault_s: float, words: str) -> None:
    assert code != 0, f"the job exited 0 after a planted fault\n{out[-4000:]}"
    assert after_fault_s < 30, f"the job took {after_fault_s:.0f}s to end after the fault"
    assert words in out, f"no {words!r} in the output\n{out[-4000:]}"
    assert "fault not detected" not in out


@needs_mpirun
@pytest.mark.parametrize("n,backend,fault", [(4, "mpi", "raise"), (2, "torch", "exit")])
def test_fault_ends_mpirun_job(n, backend, fault):
    """The last rank raises (4 ranks) or dies (2 ranks); the job ends non-zero naming it."""
    cmd = [str(MPIRUN), "-n", str(n), "--oversubscribe", *SUITE, "--backend", backend, "--fault", fault]
    # a raising rank names itself through comms' abort hook; for a dying one mpirun reports the exit
    words = f"[rank {n - 1}] RuntimeError: planted fault" if fault == "raise" else "Exit code"
    _ends_naming_rank(*_fault_job(cmd), words)


@needs_torchrun
def test_fault_ends_torchrun_job():
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--module", "gemcore.comms.conformance",
           "--backend", "torch", "--fault", "raise"]
    _ends_naming_rank(*_fault_job(cmd), "[rank 1] RuntimeError: planted fault")
