"""``run.deterministic``: PyTorch's deterministic algorithms and cuBLAS's fixed workspace while
training, the process's settings restored afterwards; on a GPU, identical bf16 runs then agree bit
for bit (without it they drifted apart after 26 steps on the H200)."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.utils.deterministic

from gemcore.determinism import CUBLAS_WORKSPACE, deterministic_algorithms


def test_the_block_switches_deterministic_algorithms_on_and_restores_them(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_algorithms():
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE
        assert not torch.utils.deterministic.fill_uninitialized_memory   # a debugging aid, twice the cost
        assert torch.empty(1 << 16).isnan().sum() < 1 << 16             # left as the allocator had it
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.utils.deterministic.fill_uninitialized_memory          # PyTorch's default is back
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with deterministic_algorithms(enabled=False):
        assert not torch.are_deterministic_algorithms_enabled()


def test_a_user_setting_is_kept_and_restored_after_an_error(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with pytest.raises(KeyError):
            with deterministic_algorithms():
                assert not torch.is_deterministic_algorithms_warn_only_enabled()
                raise KeyError("inside the run")
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.is_deterministic_algorithms_warn_only_enabled()      # the caller's mode is back
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)


def _train(tmp_path, name: str, overrides: list[str], steps: int) -> tuple[list[float], list[bool]]:
    """A `run_training` run's losses and, per step, whether deterministic algorithms were on."""
    from gemcore.config import load_config
    from gemcore.hookspecs import hookimpl
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    seen = []

    class Recorder:
        @hookimpl
        def gemcore_after_step(self, step, metrics):
            seen.append(torch.are_deterministic_algorithms_enabled())

    config = load_config(None, [*overrides, f"run.out_dir='{tmp_path}'", f"run.name='{name}'",
                                f"run.max_steps={steps}", "run.deterministic=true"])
    manager = create_plugin_manager()
    manager.register(Recorder(), name="recorder")
    run_training(config, manager)
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r], seen


def test_every_step_runs_deterministic_and_the_mode_is_off_afterwards(tmp_path):
    """Every op of the model's CPU step has a deterministic implementation (none raises)."""
    from conftest import TINY

    losses, seen = _train(tmp_path, "d", TINY, steps=3)
    assert len(losses) == 3 and all(map(torch.isfinite, torch.tensor(losses)))
    assert seen == [True, True, True]
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_identical_bf16_gpu_runs_agree_bit_for_bit(tmp_path):
    """The fast path (jfa, bf16) at the size whose runs drifted apart after 26 steps without it."""
    overrides = ["run.device='cuda'", "attention.impl='jfa'", "precision.impl='bf16'", "model.hidden=512",
                 "model.num_blocks=4", "model.num_heads=4", "run.eval_users=64"]
    first, _ = _train(tmp_path, "a", overrides, steps=40)
    second, seen = _train(tmp_path, "b", overrides, steps=40)
    assert all(seen) and len(first) == 40
    assert first == second
