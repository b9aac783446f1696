"""Nested sub-communicators on the torch backend: a split made by some ranks only must not hang."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

MPIRUN = shutil.which("mpirun", path=str(Path(sys.executable).parent))


@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun (pip install 'gemcore[mpi]')")
def test_nested_splits_under_mpirun():
    worker = Path(__file__).parent / "workers" / "torch_split_worker.py"
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    result = subprocess.run([MPIRUN, "--oversubscribe", "-n", "4", sys.executable, str(worker)],
                            capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("split OK") == 4
