"""Context parallelism beside pipeline and expert parallelism (gloo, CPU ranks under torchrun):
dp_shard=2 x cp=2 x ep=2 (experts split over each cp pair, FSDP2-sharded over dp_shard) matches a
single-process run's losses and gradient norms; ``gem train`` with pp=2 x cp=2 x ep=2 (context-
parallel pipeline stages whose experts are spread over the cp pair) trains 2 steps, saves, resumes
for a third and matches a one-process run, with a checkpoint in the one-process model's layout."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from gemcore.parallel.apply import check_supported
from gemcore.planner.plan import Plan
from gemcore.bench.planner_smoke import main as smoke_main

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, module_args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", *module_args]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_cp_combinations_are_supported():
    assert check_supported(Plan(pp=2, cp=2)) == []
    assert check_supported(Plan(pp=2, cp=2, ep=2), num_blocks=2) == []
    assert check_supported(Plan(dp_shard=2, cp=2, ep=2)) == []
    assert check_supported(Plan(cp=4, ep=2)) == []          # ep inside a cp group
    assert check_supported(Plan(dp_shard=2, cp=2, ep=4)) == []


def test_experts_beside_cp_match_single_process(capsys):
    """Experts 0-1 / 2-3 on the two ranks of each cp pair, each expert FSDP2-sharded over dp_shard;
    the cp ranks route different rows of the same users; full recompute."""
    extra = ["--experts", "4", "--steps", str(STEPS), "--same-batch"]
    assert smoke_main(extra) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    expected = out["losses"] + out["grad_norms"]
    assert expected[STEPS - 1] < expected[0] - 0.01  # the run really trains
    proc = _torchrun(4, ["gemcore.bench.planner_smoke", "--degrees", "dp_shard=2,cp=2,ep=2,ac=full", *extra])
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert "cp=2, ep=2" in out["plan"]
    assert out["losses"] + out["grad_norms"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_gem_train_pipeline_with_cp_and_experts_resumes_and_matches_one_process(tmp_path):
    """``gem train`` with pp=2 x cp=2 x ep=2 (2 micro-batches of 4 users, cut over each stage's cp
    pair): stop after 2 steps, resume for a third; losses, gradient norms and held-out AUC equal a
    one-process run's, and the checkpoint holds every expert under the one-process names."""
    from gemcore.cli.main import main

    tiny = ["--quiet", "--set", "model.hidden=16", "--set", "model.num_blocks=2", "--set", "data.num_users=64",
            "--set", "data.batch_size=8", "--set", "data.max_len=24", "--set", "run.eval_users=16",
            "--set", "train.warmup_steps=2", "--set", f"run.out_dir={tmp_path}", "--max-steps", "3",
            "--set", "model.moe_experts=4"]
    assert main(["train", *tiny, "--name", "one"]) == 0
    _torchrun(4, ["gemcore.cli.main", "train", *tiny, "--name", "cp", "--parallel", "planned",
                  "--set", "parallelism.degrees=pp=2,cp=2,ep=2,mbs=4", "--stop-after", "2"])
    _torchrun(4, ["gemcore.cli.main", "train", "--quiet", "--resume", str(tmp_path / "cp")])

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one, cp = rows("one"), rows("cp")
    assert [r["step"] for r in cp] == [1, 2, 3]
    assert [r["loss"] for r in cp] + [r["grad_norm"] for r in cp] == pytest.approx(
        [r["loss"] for r in one] + [r["grad_norm"] for r in one], rel=1e-5, abs=1e-6)
    summary = json.loads((tmp_path / "cp" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and summary["model_parallel"] == 4
    assert summary["auc"] == pytest.approx(json.loads((tmp_path / "one" / "summary.json").read_text())["auc"])
    saved, single = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in ("cp", "one"))
    assert sorted(saved["model"]) == sorted(single["model"])
    assert len(saved["optimizer"]["state"]) == len(single["optimizer"]["state"])
    for key, value in single["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=1e-4, atol=1e-6)
