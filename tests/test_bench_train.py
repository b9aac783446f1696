"""`gem bench train`: the padded baseline computes the same function as the jagged model, the FP8
configuration, and the host-synchronisation count."""
from __future__ import annotations

import pytest
import torch

from gemcore.bench.padded import PaddedGemModel
from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data import make_synthetic
from gemcore.kernels.jagged_attention import make_attention
from gemcore.model import GemModel


def test_padded_baseline_matches_the_jagged_model():
    torch.manual_seed(0)
    model = GemModel(ModelConfig(hidden=16, num_heads=2, num_blocks=2, num_items=40),
                     make_attention(AttentionConfig(), backend="reference"))
    data = make_synthetic(num_users=6, num_items=40, num_actions=4, max_len=12, num_candidates=3,
                          num_clusters=4, kind="uniform", seed=1)
    batch = data.__getitems__(range(6))
    torch.testing.assert_close(PaddedGemModel(model)(batch), model(batch), rtol=1e-4, atol=1e-5)
    (PaddedGemModel(model).loss(batch)).backward()
    assert model.blocks[0].qkv.weight.grad.abs().sum() > 0


def test_fp8_configuration_trains_and_is_compared_with_its_bf16_twin(capsys):
    """`gem bench train --configs bf16,fp8` on CPU: fp8 runs the fp8_block policy (reference GEMM)
    and its row carries tokens/s and loss relative to bf16."""
    import argparse
    import json

    from gemcore.bench import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--configs", "bf16,fp8", "--fp8-matmul", "reference",
                              "--users", "4", "--steps", "2", "--warmup", "1", "--repeats", "2", "--hidden", "128",
                              "--heads", "2", "--blocks", "1", "--items", "300", "--candidates", "2",
                              "--max-len", "16", "--no-local-mfu", "--json"])
    assert train.run(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["fp8"] == {"fp8_matmul": "reference", "fp8_fused_mlp": False, "fp8_keep": ["router", "head"]}
    rows = {r["config"]: r for r in report["results"]}
    assert rows["fp8"]["error"] == "" and rows["bf16"]["error"] == ""
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    assert rows["fp8"]["speedup_vs_bf16"] > 0
    assert abs(rows["fp8"]["loss_vs_bf16"]) < 0.05
    for row in rows.values():  # two timed passes each: the median and their spread
        runs = row["tokens_per_s_runs"]
        assert len(runs) == 2 and min(runs) <= row["tokens_per_s"] <= max(runs)
        assert row["spread"] == pytest.approx((max(runs) - min(runs)) / row["tokens_per_s"])
    assert rows["fp8"]["vs_bf16_inside_noise"] in (True, False) and rows["bf16"]["vs_bf16_inside_noise"] is None


def test_spread_and_overlap_of_timed_passes():
    from gemcore.bench.train import ranges_overlap, spread

    assert spread([90.0, 100.0, 110.0]) == pytest.approx(0.2) and spread([100.0]) is None
    assert ranges_overlap([90.0, 100.0], [99.0, 120.0]) is True
    assert ranges_overlap([90.0, 95.0], [99.0, 120.0]) is False
    assert ranges_overlap([90.0], [99.0, 120.0]) is None


def test_bad_repeats_and_profile_are_named():
    import argparse

    from gemcore.bench import train

    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    with pytest.raises(ValueError, match="--repeats must be positive, got 0"):
        train.run(parser.parse_args(["--device", "cpu", "--repeats", "0"]))
    with pytest.raises(ValueError, match="--profile profiles CUDA kernels: it needs --device cuda"):
        train.run(parser.parse_args(["--device", "cpu", "--profile"]))
    with pytest.raises(ValueError, match="--profile-top must be a count >= 0 given with --profile, got 3 without"):
        train.run(parser.parse_args(["--device", "cpu", "--profile-top", "3"]))


def test_fp8_configuration_is_built_with_the_fp8_block_policy():
    from gemcore.bench import train
    from gemcore.plugin_manager import create_plugin_manager

    cfg = ModelConfig(hidden=128, num_heads=2, num_blocks=1, num_items=40)
    _, gem, policy, desc = train.build("fp8", cfg, create_plugin_manager(), torch.device("cpu"), 0,
                                       {"fp8_matmul": "reference"})
    assert "fp8_block" in desc
    assert type(gem.blocks[0].qkv).__name__ == "FP8BlockLinear"
    assert train._bf16_twin("fp8+compile") == "bf16+compile" and train._bf16_twin("fp8") == "bf16"


def test_fp8_keep_leaves_the_named_layers_in_bf16():
    """--fp8-keep qkv,out: the attention projections stay nn.Linear, the MLP's layers turn FP8."""
    from gemcore.bench import train
    from gemcore.plugin_manager import create_plugin_manager

    cfg = ModelConfig(hidden=128, num_heads=2, num_blocks=1, num_items=40)
    _, gem, policy, _ = train.build("fp8", cfg, create_plugin_manager(), torch.device("cpu"), 0,
                                    {"fp8_matmul": "reference", "fp8_keep": ["router", "head", "qkv", "out"]})
    block = gem.blocks[0]
    assert type(block.qkv) is torch.nn.Linear and type(block.out) is torch.nn.Linear
    assert type(block.mlp.gate_up).__name__ == "FP8BlockLinear"
    assert all(".qkv" not in name and ".out" not in name for name in policy.converted)


@pytest.mark.parametrize("scope", ["block", "dense"])
def test_compile_scope_picks_what_is_compiled(scope):
    """+compile wraps each block whole (block) or its MLP and norms (dense); nothing else."""
    from gemcore.bench import train
    from gemcore.plugin_manager import create_plugin_manager

    cfg = ModelConfig(hidden=32, num_heads=2, num_blocks=2, num_items=40)
    _, gem, _, _ = train.build("bf16+compile", cfg, create_plugin_manager(), torch.device("cpu"), 0,
                               compile_scope=scope)
    compiled = torch._dynamo.eval_frame.OptimizedModule
    for block in gem.blocks:
        assert isinstance(block, compiled) is (scope == "block")
        inner = block._orig_mod if scope == "block" else block
        assert isinstance(inner.mlp, compiled) is (scope == "dense")
        assert not isinstance(inner.qkv, compiled)
    _, plain, _, _ = train.build("bf16", cfg, create_plugin_manager(), torch.device("cpu"), 0, compile_scope=scope)
    assert not any(isinstance(m, compiled) for m in plain.modules())


def test_compile_scope_is_checked():
    from gemcore.bench import train
    from gemcore.plugin_manager import create_plugin_manager

    cfg = ModelConfig(hidden=32, num_heads=2, num_blocks=1, num_items=40)
    with pytest.raises(ValueError, match="compile_scope must be one of"):
        train.build("bf16+compile", cfg, create_plugin_manager(), torch.device("cpu"), 0, compile_scope="model")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (counts CUDA host synchronisations)")
def test_sync_count_sees_a_blocking_read_and_not_the_profiler():
    from gemcore.bench.train import count_syncs

    x = torch.ones(1024, device="cuda")
    batches = [0, 1, 2]
    assert count_syncs(lambda b: x.mul_(1.0), batches, x.device) == 0
    assert count_syncs(lambda b: x.sum().item(), batches, x.device) >= 1


def test_profile_breakdown_and_top_kernels_are_printed(monkeypatch, capsys):
    """The report prints each profiled configuration's kinds and costliest kernels (the profile
    itself needs a GPU: here the configurations' results carry one)."""
    import argparse

    from gemcore.bench import train

    def fake(config, *args, **kwargs):
        return train.Result(config, tokens_per_s=1000.0, step_ms=10.0, tokens_per_s_runs=[1000.0],
                            gpu_ms_by_kind={"gemm": 6.0, "attention": 2.0, "total": 8.0}, kernels_per_step=400.0,
                            top_kernels=[{"name": "nvjet_gemm", "kind": "gemm", "ms_per_step": 6.0,
                                          "calls_per_step": 3.0, "us_per_call": 2000.0}])

    monkeypatch.setattr(train, "train_config", fake)
    parser = argparse.ArgumentParser()
    train.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--configs", "bf16", "--users", "2", "--steps", "1",
                              "--warmup", "0", "--hidden", "32", "--heads", "2", "--blocks", "1", "--items", "300",
                              "--candidates", "1", "--max-len", "8", "--no-local-mfu"])
    assert train.run(args) == 0
    out = capsys.readouterr().out
    assert "GPU busy 8.0 ms (80 % of the 10.0 ms step) | gemm 6.0 | attention 2.0 | 400 kernels, idle 5.0 us each" in out
    assert "bf16: the 1 costliest kernels" in out and "nvjet_gemm" in out


def test_graphs_suffix_names_and_twins():
    from gemcore.bench import train

    assert train.config_parts("fp8+compile+graphs") == ("fp8", ("compile", "graphs"))
    assert train._bf16_twin("bf16+compile+graphs") == "bf16+compile"
    assert train._bf16_twin("fp8+compile+graphs") == "bf16+compile+graphs"
    assert train._bf16_twin("bf16+graphs") == "bf16"
    for bad in ("padded+graphs", "fp8+graphs+compile", "bf16+graphs+graphs", "bf16+fast"):
        with pytest.raises(ValueError, match=f"--configs: unknown {bad.replace('+', '[+]')};"):
            train.config_parts(bad)
