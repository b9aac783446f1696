"""The ce backend under torch.distributed on a GPU: two processes sharing one GPU (NCCL refuses
that) run the conformance suite through ``dist.*`` on the ``gemcore_ce`` process group, the
benchmark's smoke run through the same API, and the SM-free profile. Skipped without a CUDA GPU
or CuPy."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("cupy") is None, reason="needs CuPy (the 'gpu' extra)"),
]


def _torchrun(*args: str, n: int = 2, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


def test_dist_conformance_on_one_gpu():
    """Every torch.distributed entry point training calls, on ``gemcore_ce`` (default sync: flags;
    the other modes run the communicator-level suite in tests/test_comms_ce.py)."""
    proc = _torchrun("-m", "gemcore.comms.dist_conformance", "--backend", "ce", "--device", "cuda")
    for rank in range(2):
        assert f"[rank {rank}] gemcore_ce: " in proc.stdout and "checks passed on cuda" in proc.stdout, proc.stdout


def test_bench_smoke_through_torch_distributed():
    proc = _torchrun("-m", "gemcore.cli.main", "bench", "comms", "--backend", "ce", "--api", "dist", "--op",
                     "all_gather,reduce_scatter,all_reduce", "--min-bytes", "4K", "--max-bytes", "64K", "--step-factor", "4",
                     "--iters", "5", "--warmup", "2", "--anchor")
    out = proc.stdout
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        assert f"# {op}, backend ce, 2 ranks" in out, out
    assert "gpu-only(us)" in out and "bus/d2d%" in out and "sync flags" in out, out


@pytest.mark.parametrize("extra", [[], ["--fsdp"]])
def test_sm_free_profile(extra):
    """No kernel inside the copy-engine exchanges; the reductions' kernels are the counted ones."""
    proc = _torchrun("-m", "gemcore.cli.main", "bench", "comms", "--backend", "ce", "--sm-free", "--op",
                     "all_gather,reduce_scatter", "--max-bytes", "4M", "--iters", "3", *extra)
    assert "FAIL" not in proc.stdout and proc.stdout.count("PASS") >= 4, proc.stdout
