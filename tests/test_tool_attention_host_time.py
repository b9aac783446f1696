"""tools/attention_host_time.py: its argument checks on any machine, and on a GPU one run that
prints the host time per call of every attention it compares."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOL = Path(__file__).resolve().parents[1] / "tools" / "attention_host_time.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args,message", [(("--batch", "0"), "--batch must be >= 1, got 0"),
                                          (("--max-len", "0"), "--max-len must be >= 1, got 0"),
                                          (("--workload", "dense"), "--workload: invalid choice: 'dense'")])
def test_bad_arguments_are_named(args, message):
    run = _run(*args)
    assert run.returncode == 2 and message in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_without_a_gpu_it_says_so():
    run = _run()
    assert run.returncode == 1 and "needs a CUDA GPU" in run.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_prints_host_time_per_call_on_a_gpu():
    run = _run("--batch", "4", "--max-len", "64")
    assert run.returncode == 0, run.stderr
    for name in ("gemcore softmax", "gemcore silu", "varlen_attn"):
        line = next(line for line in run.stdout.splitlines() if line.startswith(name))
        assert "fwd" in line and "fwd+bwd" in line and " us" in line
