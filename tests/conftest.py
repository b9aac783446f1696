"""Shared fixtures: tiny configs and a way to run the ``gem`` CLI as a user would."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

#: overrides that make a `gem train` run take a few seconds on one core
TINY = ["model.hidden=16", "model.num_heads=2", "model.num_blocks=1", "model.num_items=64",
        "data.num_users=256", "data.max_len=32", "data.batch_size=16", "run.eval_users=64",
        "train.warmup_steps=2"]


def tiny_set_args(extra: list[str] = ()) -> list[str]:
    args: list[str] = []
    for item in [*TINY, *extra]:
        args += ["--set", item]
    return args


def run_gem(args: list[str], cwd: Path, env_extra: dict[str, str] | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``gem ARGS`` in a fresh interpreter (entry points and all), capturing output."""
    env = {k: v for k, v in os.environ.items() if k != "GEMCORE_DISABLE_PLUGINS"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "gemcore.cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@dataclass
class GemResult:
    returncode: int
    stdout: str
    stderr: str


def gem(args: list[str], cwd: Path, monkeypatch) -> GemResult:
    """Run ``gem ARGS`` in this process (fast: torch is already imported), in folder ``cwd``."""
    from gemcore.cli.main import main

    monkeypatch.chdir(cwd)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exc:  # argparse errors
            code = exc.code
    return GemResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def tiny_args():
    return tiny_set_args


@pytest.fixture
def one_rank_group():
    """A one-process gloo default group, destroyed afterwards (skipped if one already exists)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()
