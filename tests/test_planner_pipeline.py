"""Pipeline parallelism (pp > 1) through torch.distributed.pipelining: the stages' composition
equals GemModel on jagged micro-batches (one process), losses and gradient norms of pp=2
interleaved and dp_shard=2 x pp=2 runs match a single-process run (gloo, CPU ranks under torchrun),
``gem train`` trains and resumes with a pipeline (and with experts spread over the ranks), and bad
input names the argument."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from gemcore.kernels.jagged_attention import make_attention

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data.dataset import JaggedBatch
from gemcore.model import GemModel
from gemcore.parallel.apply import check_supported
from gemcore.parallel.pipeline import (
    GemStage,
    StepContext,
    padded_rows,
    split_micro_batches,
    stage_blocks,
)
from gemcore.planner.plan import Plan
from gemcore.bench.planner_smoke import main as smoke_main

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _torchrun(nproc: int, module_args: list[str], timeout: float = 150) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", *module_args]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, env=_env())
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def _smoke(nproc: int, degrees: str, *extra: str) -> list[float]:
    proc = _torchrun(nproc, ["gemcore.bench.planner_smoke", "--degrees", degrees, "--steps", str(STEPS), *extra])
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert f"pp={degrees.split('pp=')[1].split(',')[0]}" in out["plan"]
    return out["losses"] + out["grad_norms"]


def _reference(capsys, *extra: str) -> list[float]:
    assert smoke_main(["--steps", str(STEPS), *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out["losses"] + out["grad_norms"]


@pytest.mark.parametrize("nproc, degrees, extra", [
    # two stages per rank (ScheduleInterleaved1F1B, 4 micro-batches of 2 users); a new batch every
    # step: each step's padded row count differs, so the stages are rebuilt
    (2, "pp=2,v=2,mbs=2", ("--blocks", "4", "--max-len", "40")),
    # Schedule1F1B with FSDP2 per stage on the 2-D (pp, dp_shard) mesh, recompute, 2 micro-batches
    # of 2 users per rank
    (4, "dp_shard=2,pp=2,mbs=2,ac=full", ("--blocks", "2", "--same-batch")),
    # tensor parallelism inside each stage (the blocks' MLP and attention over tp=2), 2 stages
    (4, "pp=2,tp=2,mbs=3", ("--blocks", "4")),
    # expert parallelism inside each stage: 4 experts over dp_shard=2, outside the stages' FSDP2
    (4, "dp_shard=2,ep=2,pp=2,mbs=2", ("--blocks", "2", "--experts", "4")),
])
def test_pipeline_losses_match_single_process(capsys, nproc, degrees, extra):
    expected = _reference(capsys, *extra)
    if "--same-batch" in extra:
        assert expected[STEPS - 1] < expected[0] - 0.01  # the run really trains
    got = _smoke(nproc, degrees, *extra)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("nproc, degrees, experts", [
    (2, "pp=2,mbs=5", 0),       # a pipeline, micro-batches of 5 and 3 users
    (2, "dp_shard=2,ep=2", 4),  # experts spread over the ranks: each rank's must reach the checkpoint
    (4, "dp_shard=4,ep=2", 4),  # ... and FSDP2-sharded over the other ranks (DTensor experts)
    # TP reorders gate_up/qkv rows: the checkpoint must hold the model's own layout; the two tp
    # ranks of data-parallel rank 0 must not both write the metrics
    (4, "dp_shard=2,ep=2,tp=2", 4),
])
def test_gem_train_with_a_plan_resumes_and_matches_one_process(tmp_path, nproc, degrees, experts):
    """``gem train --parallel planned``: 2 steps, save, resume for a third; the losses, gradient
    norms and held-out AUC equal a one-process run's, and the checkpoint holds the one-process
    model's names (every expert, whichever rank held it)."""
    from gemcore.cli.main import main

    tiny = ["--quiet", "--set", "model.hidden=16", "--set", "model.num_blocks=2", "--set", "data.num_users=64",
            "--set", "data.batch_size=8", "--set", "data.max_len=24", "--set", "run.eval_users=16",
            "--set", "train.warmup_steps=2", "--set", f"run.out_dir={tmp_path}", "--max-steps", "3",
            "--set", f"model.moe_experts={experts}"]
    assert main(["train", *tiny, "--name", "one"]) == 0
    gem = ["gemcore.cli.main", "train", *tiny, "--name", "pp", "--parallel", "planned",
           "--set", f"parallelism.degrees={degrees}", "--stop-after", "2"]
    first = _torchrun(nproc, gem)
    _torchrun(nproc, ["gemcore.cli.main", "train", "--quiet", "--resume", str(tmp_path / "pp")])
    # one summary (global rank 0's), naming the run folder that exists
    assert first.stdout.count("gem train:") == 1 and first.stdout.count("held-out AUC") == 1, first.stdout

    def rows(name):
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    one, pp = rows("one"), rows("pp")
    assert [r["step"] for r in pp] == [1, 2, 3]
    assert [r["loss"] for r in pp] + [r["grad_norm"] for r in pp] == pytest.approx(
        [r["loss"] for r in one] + [r["grad_norm"] for r in one], rel=1e-5, abs=1e-6)
    summary = json.loads((tmp_path / "pp" / "summary.json").read_text())
    assert summary["resumed_from_step"] == 2 and degrees.split(",")[0] in summary["parallelism"]
    # the whole model's parameters, not one stage's or one shard's
    assert summary["parameters"] == json.loads((tmp_path / "one" / "summary.json").read_text())["parameters"]
    # rates are per device: a pipeline's (or a tp group's) ranks share each batch
    plan = Plan.parse(degrees)
    assert summary["model_parallel"] == plan.tp * plan.cp * plan.pp
    assert summary["tokens_per_s"] == pytest.approx(
        summary["tokens"] / summary["train_time_s"] / summary["model_parallel"])
    saved, single = (torch.load(tmp_path / name / "checkpoint.pt", weights_only=False) for name in ("pp", "one"))
    assert sorted(saved["model"]) == sorted(single["model"])
    assert len(saved["optimizer"]["state"]) == len(single["optimizer"]["state"])
    for key, value in single["model"].items():
        torch.testing.assert_close(saved["model"][key], value, rtol=1e-4, atol=1e-6)
    assert summary["auc"] == pytest.approx(json.loads((tmp_path / "one" / "summary.json").read_text())["auc"])


def _random_batch(gen: torch.Generator, users: int, num_items: int) -> JaggedBatch:
    lengths = torch.randint(0, 9, (users,), generator=gen)
    lengths[0], lengths[-1] = 0, 1                       # an empty and a length-1 history
    cands = torch.randint(1, 4, (users,), generator=gen)
    T, C = int(lengths.sum()), int(cands.sum())
    seq = lengths + cands
    return JaggedBatch(item_ids=torch.randint(0, num_items, (T,), generator=gen),
                       actions=torch.randint(0, 2, (T,), generator=gen),
                       time_buckets=torch.randint(0, 8, (T,), generator=gen),
                       offsets=torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
                       cand_ids=torch.randint(0, num_items, (C,), generator=gen),
                       cand_offsets=torch.cat([torch.zeros(1, dtype=torch.int64), cands.cumsum(0)]),
                       labels=torch.randint(0, 2, (C,), generator=gen).float(),
                       max_len=int(seq.max()), sum_sq_len=int((seq ** 2).sum()))


@pytest.mark.parametrize("num_stages, mbs", [(2, 1), (2, 3), (4, 2)])
def test_stages_compose_to_the_model_on_padded_micro_batches(num_stages, mbs):
    """One process: the stages run in order on each micro-batch (padded activation with
    the candidates' item embeddings riding along) give GemModel's logits and gradients (float32: the attention hook's dtypes; the sums differ in
    order only)."""
    torch.manual_seed(1)
    cfg = ModelConfig(num_items=50, hidden=16, num_blocks=4, num_heads=2, mlp_ratio=2)
    model = GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))
    batch = _random_batch(torch.Generator().manual_seed(num_stages * 10 + mbs), users=7, num_items=50)
    model(batch).sum().backward()    # reference gradients
    expected_logits = model(batch).detach()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    context = StepContext()
    blocks = stage_blocks(cfg.num_blocks, num_stages)
    stages = [GemStage(model, s, num_stages, blocks[s], context, torch.float32) for s in range(num_stages)]
    micro = split_micro_batches(batch, mbs)
    assert sum(m.batch.batch_size for m in micro) == batch.batch_size
    context.begin(micro, padded_rows(max(m.rows + m.cands for m in micro)), padded_rows(max(m.cands for m in micro)))
    logits = []
    for i, m in enumerate(micro):
        h = torch.tensor([i])
        for stage in stages:
            h = stage(h)
            assert h.shape == ((context.rows, cfg.hidden) if not stage.is_last else (context.cands,))
        logits.append(h[:m.cands])
        h[:m.cands].sum().backward()
    torch.testing.assert_close(torch.cat(logits), expected_logits, rtol=1e-5, atol=1e-6)
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_padded_rows_bounds_padding_and_sizes():
    sizes = {padded_rows(n) for n in range(1000, 2000)}
    assert len(sizes) <= 9
    for n in [0, 1, 7, 8, 9, 100, 1023, 1024, 1025, 5000]:
        assert max(n, 1) <= padded_rows(n) <= max(n * 1.125, 1)


def test_bad_pipeline_input_names_the_argument():
    with pytest.raises(ValueError, match=r"pp × virtual_stages = 2 × 1 = 2 .*model.num_blocks = 3"):
        stage_blocks(3, 2)
    with pytest.raises(ValueError, match=r"pp × virtual_stages = 2 × 2 = 4 .*model.num_blocks = 6"):
        stage_blocks(6, 2, 2)
    assert check_supported(Plan(pp=2, cp=2)) == []   # tests/test_planner_cp_combos.py
    assert check_supported(Plan(pp=2, dp_shard=2, ep=2)) == []
    assert check_supported(Plan(pp=2, dp_shard=2)) == []
    assert check_supported(Plan(pp=2, tp=2)) == []
    assert check_supported(Plan(pp=2, dp_shard=2), num_blocks=4) == []
    assert "model.num_blocks = 3" in " ".join(check_supported(Plan(pp=2), num_blocks=3))
    assert check_supported(Plan(pp=2, dp_replicate=2, dp_shard=2, schedule="interleaved", virtual_stages=2)) == []
    from gemcore.parallel.planned import PlannedParallelism

    # refused before any process group is made (a valid 4-rank plan here would wait for 3 peers)
    env = {"rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 2}
    with pytest.raises(ValueError, match=r"parallelism.degrees: .* = 4, but 2 processes were launched"):
        PlannedParallelism(Plan(pp=2, cp=2), env)
