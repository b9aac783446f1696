"""FSDP2 training through the copy-engine backend: two processes sharing one GPU (NCCL refuses
that) train with every all-gather and reduce-scatter on ``gemcore_ce``, and their losses equal the
one-process run's (1e-5 in float32, 1e-3 in bfloat16)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TORCHRUN = Path(sys.executable).parent / "torchrun"
STEPS = 6


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in open(run_dir / "metrics.jsonl") if '"loss"' in line]


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc


@pytest.mark.parametrize("precision,tol", [("fp32", 1e-5), ("bf16", 1e-3)])
def test_two_processes_on_one_gpu_train_like_one(precision, tol, tmp_path):
    pytest.importorskip("cupy", reason="the ce backend needs CuPy")
    common = ["train", "--device", "cuda", "--max-steps", str(STEPS), "--set", f"precision.impl={precision}"]
    gem = [sys.executable, "-m", "gemcore.cli.main"]
    _run([*gem, *common, "--name", "one"], tmp_path)
    _run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "-m", "gemcore.cli.main", *common,
          "--name", "ce", "--parallel", "fsdp", "--set", "comms.backend=ce"], tmp_path)
    summary = json.loads((tmp_path / "runs" / "ce" / "summary.json").read_text())
    assert summary["mesh_carriers"] == {"dp_shard": "gemcore_ce"}, summary["mesh_carriers"]
    one, ce = _losses(tmp_path / "runs" / "one"), _losses(tmp_path / "runs" / "ce")
    assert len(one) == len(ce) == STEPS
    assert max(abs(a - b) for a, b in zip(one, ce)) <= tol, (one, ce)
