"""`gem train` end to end at tiny size, `gem info`, `gem plugins`, and exit codes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import gem, tiny_set_args


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_gem_train_console_script_end_to_end(tmp_path):
    """The installed `gem` script, as a user runs it: files, rows, summary."""
    exe = shutil.which("gem", path=str(Path(sys.executable).parent))
    assert exe, "the gem console script is not installed beside this interpreter"
    result = subprocess.run([exe, "train", "--name", "e2e", "--max-steps", "6", "--seed", "3",
                             *tiny_set_args()], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    run_dir = tmp_path / "runs" / "e2e"
    for name in ("config.toml", "metrics.jsonl", "summary.json", "curves.png", "checkpoint.pt"):
        assert (run_dir / name).stat().st_size > 0, name
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["mfu"] is None  # CPU: peak unknown
    assert summary["tokens_per_s"] > 0 and 0.0 <= summary["auc"] <= 1.0
    assert "held-out AUC" in result.stdout and "MFU" in result.stdout and "n/a" in result.stdout
    assert (run_dir / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_default_run_beats_chance(tmp_path):
    """`make train` as a user runs it (the default config, no overrides): its held-out AUC is well
    above chance (0.5). The default run reaches about 0.66."""
    exe = shutil.which("gem", path=str(Path(sys.executable).parent))
    result = subprocess.run([exe, "train", "--name", "default", "--quiet"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=3600)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "default" / "summary.json").read_text())
    assert summary["steps"] == 300 and summary["stopped"] == "max_steps"
    assert summary["auc"] > 0.6, summary["auc"]


def test_same_seed_same_losses(tmp_path, monkeypatch):
    losses = []
    for name in ("a", "b"):
        result = gem(["train", "--quiet", "--name", name, "--max-steps", "4", "--seed", "7",
                      *tiny_set_args()], tmp_path, monkeypatch)
        assert result.returncode == 0, result.stderr
        losses.append([r["loss"] for r in read_rows(tmp_path / "runs" / name)])
    assert losses[0] == losses[1]
    other = gem(["train", "--quiet", "--name", "c", "--max-steps", "4", "--seed", "8", *tiny_set_args()],
                tmp_path, monkeypatch)
    assert other.returncode == 0
    assert [r["loss"] for r in read_rows(tmp_path / "runs" / "c")] != losses[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error; this machine has a GPU")
def test_device_cuda_without_gpu_is_exit_2(tmp_path, monkeypatch):
    result = gem(["train", "--quiet", "--device", "cuda", "--max-steps", "1", *tiny_set_args()],
                 tmp_path, monkeypatch)
    assert result.returncode == 2
    assert "--device cuda" in result.stderr and "Traceback" not in result.stderr


def test_bad_flag_values_are_exit_2(tmp_path, monkeypatch):
    assert gem(["train", "--device", "tpu"], tmp_path, monkeypatch).returncode == 2
    assert gem(["train", "--max-steps", "many"], tmp_path, monkeypatch).returncode == 2
    assert gem(["nonsense"], tmp_path, monkeypatch).returncode == 2
    result = gem(["train", "--quiet", "--resume", str(tmp_path / "nowhere")], tmp_path, monkeypatch)
    assert result.returncode == 2 and "--resume" in result.stderr


def test_gem_info(tmp_path, monkeypatch):
    result = gem(["info"], tmp_path, monkeypatch)
    assert result.returncode == 0
    for needle in ("python", "torch", "triton", "pluggy", "mpi4py", "cupy", "GPUs", "attention"):
        assert needle in result.stdout, needle


def test_gem_info_says_which_backends_a_missing_extra_disables(tmp_path, monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "mpi4py" else real_find_spec(name, *a))
    result = gem(["info"], tmp_path, monkeypatch)
    assert result.returncode == 0
    assert "mpi (unusable here: needs mpi4py" in result.stdout
    if not torch.cuda.is_available():
        assert "ce (unusable here: needs a CUDA GPU)" in result.stdout


def test_gem_plugins_json_lists_every_hook_point(tmp_path, monkeypatch):
    result = gem(["plugins", "--json", "--set", "precision.impl=bf16"], tmp_path, monkeypatch)
    info = json.loads(result.stdout)
    assert set(info["hook_points"]) == {"attention", "precision", "parallelism", "communication", "data"}
    assert info["hook_points"]["precision"]["selected"] == "bf16"
    names = {i["name"] for i in info["hook_points"]["precision"]["implementations"]}
    assert {"fp32", "bf16"} <= names
    loaded = {p["name"] for p in info["plugins"] if p["status"] == "loaded"}
    assert {"attention_reference", "precision_basic", "parallel_single", "data_random"} <= loaded


def test_bf16_policy_trains(tmp_path, monkeypatch):
    result = gem(["train", "--quiet", "--name", "bf", "--max-steps", "3", "--set", "precision.impl=bf16",
                  *tiny_set_args()], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    assert all(r["loss"] == r["loss"] for r in read_rows(tmp_path / "runs" / "bf"))  # no NaN


def test_user_data_from_jsonl(tmp_path, monkeypatch):
    rows = [{"user_id": i, "items": [1, 2, 3][: i % 4], "actions": [0, 1, 2][: i % 4],
             "candidates": [5, 6], "labels": [i % 2, 1 - i % 2]} for i in range(40)]
    path = tmp_path / "users.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    result = gem(["train", "--quiet", "--name", "own", "--max-steps", "2", *tiny_set_args(),
                  "--set", "data.source=jsonl", "--set", f"data.path='{path}'"], tmp_path, monkeypatch)
    assert result.returncode == 0, result.stderr
    path.write_text(json.dumps({"items": [1], "candidates": [2], "labels": [1, 0]}))
    bad = gem(["train", "--quiet", "--max-steps", "1", *tiny_set_args(), "--set", "data.source=jsonl",
               "--set", f"data.path='{path}'"], tmp_path, monkeypatch)
    assert bad.returncode == 2 and "labels" in bad.stderr and "line 1" in bad.stderr
