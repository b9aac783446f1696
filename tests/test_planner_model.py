"""Planner as data: plan validation, presets, hand-computed memory/FLOPs/comm, search invariants."""
import dataclasses
import math

import pytest

from gemcore.planner.cluster import Cluster, GpuKind, Tier, make_cluster
from gemcore.planner.cost import estimate, ring_time
from gemcore.planner.models import PRESETS, ModelSpec, history_lengths, load_model
from gemcore.planner.plan import MeshAxis, Plan, PlanError
from gemcore.planner.search import search

TINY = ModelSpec("tiny", num_layers=2, hidden=8, num_heads=2, num_kv_heads=2, ffn=16, vocab_size=10, seq_len=4)


# ---------------------------------------------------------------------- plan
def test_plan_error_prints_every_factor():
    with pytest.raises(PlanError) as err:
        Plan(dp_replicate=2, dp_shard=4, tp=8, world_size=128)
    msg = str(err.value)
    for text in ("pp=1", "dp_replicate=2", "dp_shard=4", "cp=1", "tp=8", "= 64", "128"):
        assert text in msg


@pytest.mark.parametrize("kwargs, word", [({"tp": 0}, "tp"), ({"ep": 3, "dp_shard": 4}, "ep=3"),
                                          ({"ac": "some"}, "ac"), ({"virtual_stages": 2}, "interleaved")])
def test_plan_rejects_bad_degrees(kwargs, word):
    with pytest.raises(PlanError, match=word):
        Plan(**kwargs)


def test_plan_parse_and_strides():
    plan = Plan.parse("dp_shard=4, tp=2, pp=2, ac=full, v=2")
    assert (plan.dp_shard, plan.tp, plan.pp, plan.ac, plan.schedule, plan.virtual_stages) == (
        4, 2, 2, "full", "interleaved", 2)
    assert plan.stride(MeshAxis.TP) == 1 and plan.stride(MeshAxis.DP_SHARD) == 2
    assert plan.stride(MeshAxis.PP) == 8 and plan.num_gpus == 16
    for bad in ("dp_shard", "foo=2", "tp=two", "reshard=maybe"):
        with pytest.raises(ValueError, match="--degrees"):
            Plan.parse(bad)


def test_fsdp_reshards_after_forward_unless_pipelined_by_default():
    """TorchTitan's default policy: a pipeline keeps the gathered weights (each micro-batch would
    gather them again); an explicit setting wins either way."""
    assert Plan(dp_shard=8).reshard_after_forward is True
    assert Plan(dp_shard=4, pp=2).reshard_after_forward is False
    assert Plan.parse("dp_shard=4,pp=2").reshard_after_forward is False
    assert Plan.parse("dp_shard=4,pp=2,reshard=true").reshard_after_forward is True
    assert Plan.parse("dp_shard=8,reshard=false").reshard_after_forward is False
    model = PRESETS["deepseek-v3"]
    cluster = make_cluster("h200", 256, 8)
    kept, resharded = (estimate(model, cluster, Plan.parse(text), seq_len=4096, global_batch=256)
                       for text in ("pp=16,dp_shard=2,tp=8", "pp=16,dp_shard=2,tp=8,reshard=true"))
    # 128 micro-batches: resharded, every one gathers the stage's weights in its forward and backward
    assert resharded.comm_exposed_s["fsdp"] > 50 * kept.comm_exposed_s["fsdp"]
    assert kept.memory_total > resharded.memory_total


def test_violations_name_each_rule():
    model = PRESETS["llama3-8b"]
    problems = Plan(tp=3, pp=64, ep=1).violations(model, global_batch=8, world_size=192)
    text = " | ".join(problems)
    assert "tp=3 must divide the heads (32)" in text
    assert "exceeds the layers (32)" in text
    assert "needs at least 64 micro-batches" in text
    assert Plan(ep=2, dp_shard=2).violations(model, 2, 2) == [
        "ep=2 needs a mixture-of-experts model; llama3-8b is dense"]


# ---------------------------------------------------------------------- models
@pytest.mark.parametrize("name, published", [("llama3-8b", 8.03e9), ("llama3-70b", 70.6e9),
                                             ("llama3-405b", 405.9e9), ("deepseek-v3", 671e9)])
def test_preset_parameter_counts_match_published(name, published):
    assert PRESETS[name].total_params() == pytest.approx(published, rel=0.01)


def test_deepseek_active_parameters():
    spec = PRESETS["deepseek-v3"]   # 37B activated (incl. the 0.93B embedding)
    assert spec.active_matmul_params() + spec.embedding_params() == pytest.approx(37e9, rel=0.03)


def test_model_file_and_errors(tmp_path):
    f = tmp_path / "m.toml"
    f.write_text('[model]\nbase = "llama3-8b"\nnum_layers = 16\n')
    spec = load_model(str(f))
    assert spec.num_layers == 16 and spec.hidden == 4096 and spec.name == "llama3-8b"
    f.write_text('[model]\nnum_layers = 2\nhiden = 8\n')
    with pytest.raises(ValueError, match="hiden"):
        load_model(str(f))
    with pytest.raises(ValueError, match="--model"):
        load_model("no-such-preset")


def test_unknown_length_law_names_the_key():
    with pytest.raises(ValueError, match="model.length_law"):
        history_lengths("zipf", 10, 64)


# ---------------------------------------------------------------------- cost formulas
def test_memory_matches_hand_count():
    cluster = make_cluster("h100", 2)
    est = estimate(TINY, cluster, Plan(dp_shard=2), seq_len=4, global_batch=2)
    # per layer: q 8*2*4=64, k+v 8*2*(4+4)=128, o 64, norms 16, MLP 3*8*16=384 -> 656; 2 layers 1312
    # + embedding 80 + head 80 = 1472 weights, sharded over 2 -> 736 per GPU
    # parameters: 4 B * 736 + two gathered bf16 layers 2 * 656 * 2 B + the root (embedding + head,
    # never resharded after the forward) 160 * 2 B = 2944 + 2624 + 320
    assert est.memory["parameters"] == 5888
    assert est.memory["gradients"] == 5568          # 4 B * 736 + the two layers' bf16 gradients
    assert est.memory["optimizer"] == 8 * 736
    # activations per token-layer: attention 2h + q 8 + kv 16 + out 8 = 48, MLP 2h + 3F = 64 -> 112
    # elements * 2 B * 4 tokens * 2 layers = 1792, + the fused loss's 4 B * 4 tokens * 10 vocab = 160
    assert est.memory["activations"] == 1952
    # one micro-batch: the peak holds the larger of gradients and activations, not both
    assert est.memory_total == 5888 + 8 * 736 + 5568
    two = estimate(TINY, cluster, Plan(dp_shard=2), seq_len=4, global_batch=4)     # 2 micro-batches
    assert two.num_microbatches == 2
    assert two.memory_total == sum(two.memory.values())


TINY_MOE = dataclasses.replace(TINY, name="tiny-moe", num_experts=4, top_k=2)


@pytest.mark.parametrize("reshard", [True, False])
def test_fsdp_gathers_only_the_ep_groups_experts(reshard):
    """Each GPU holds 1/ep of the experts, so an FSDP all-gather brings back its group's share:
    per MoE layer 4 experts x 3 x 8 x 16 = 1536 weights, 768 with ep=2. The sharded state
    (16 B per weight over dp_shard) does not depend on ep."""
    cluster = make_cluster("h100", 4)
    one, two = (estimate(TINY_MOE, cluster, Plan(dp_shard=4, ep=ep, reshard_after_forward=reshard),
                         seq_len=4, global_batch=4) for ep in (1, 2))
    assert one.memory["optimizer"] == two.memory["optimizer"]
    # resharded: two gathered layers (bf16 weights and gradients); else the stage's bf16 weights
    # and fp32 unsharded gradients
    layers = 2
    weight_bytes, grad_bytes = (2, 2) if reshard else (2, 4)
    assert one.memory["parameters"] - two.memory["parameters"] == weight_bytes * layers * 768
    assert one.memory["gradients"] - two.memory["gradients"] == grad_bytes * layers * 768
    # ep=2 gathers each expert group's 768 weights per layer among 2 GPUs instead of 1536 among 4
    assert two.comm_exposed_s["fsdp"] < one.comm_exposed_s["fsdp"]


def test_peak_memory_holds_gradients_or_activations():
    from gemcore.planner.cost import peak_memory

    split = {"parameters": 1.0, "optimizer": 2.0, "gradients": 10.0, "activations": 30.0}
    assert peak_memory(split, accumulates=False) == 33.0
    assert peak_memory(split, accumulates=True) == 43.0
    assert peak_memory({**split, "gradients": 50.0}, accumulates=False) == 53.0


def test_flops_match_hand_count():
    est = estimate(TINY, make_cluster("h100", 2), Plan(dp_shard=2), seq_len=4, global_batch=2)
    # 6 * (1312 + 80 head) * 8 tokens + causal attention 3 * 2 heads * (4+4) * 2 layers * 2 seqs * 16
    assert est.model_flops_per_step == 6 * 1392 * 8 + 3 * 2 * 8 * 2 * 2 * 16


def test_single_gpu_time_matches_hand_count():
    gpu = GpuKind("unit", hbm_gb=1, peak_bf16_tflops=1, hbm_gbps=1, intra_node_gbps=1, inter_node_gbps=1,
                  gemm_efficiency=0.5, attention_efficiency=0.25, memory_efficiency=1.0)
    est = estimate(TINY, Cluster(gpu, 1, 1), Plan(), seq_len=4, global_batch=1)
    t_gemm = 6 * 1392 * 4 / (1e12 * 0.5 * (4 / 68))              # thinnest GEMM side: 4 tokens
    t_attn = 3.5 * 2 * 8 * 2 * 16 / (1e12 * 0.25)                 # flash backward recomputes QKᵀ
    ew = 10 * 8 + 2 * (2 + 2) * 4 + 3 * 16                         # norms, adds, RoPE, SiLU*mul
    t_ew = (2 * 3 * ew * 2 * 4 + 6 * 4 * 10) / 1e9                  # + cross-entropy on 4 x 10 logits
    t_opt = 32 * 1472 / 1e9
    assert est.compute_s == pytest.approx(t_gemm + t_attn + t_ew + t_opt, rel=1e-12)
    assert est.step_time_s == pytest.approx(est.compute_s) and not est.comm_exposed_s


def test_eager_kernels_and_power_cap_match_hand_count():
    gpu = GpuKind("unit", hbm_gb=1, peak_bf16_tflops=1, hbm_gbps=1, intra_node_gbps=1, inter_node_gbps=1,
                  gemm_efficiency=0.5, attention_efficiency=0.25, memory_efficiency=1.0,
                  tdp_w=800, power_limit_w=100)
    assert gpu.clock_factor == pytest.approx(0.5)                  # (100 / 800)^(1/3)
    est = estimate(TINY, Cluster(gpu, 1, 1, kernels="eager"), Plan(), seq_len=4, global_batch=1)
    t_gemm = 6 * 1392 * 4 / (0.5e12 * 0.5 * (4 / 68))
    t_attn = 3.5 * 2 * 8 * 2 * 16 / (0.5e12 * 0.25)
    # per token and layer: 2 fp32-upcast norms 36 B/elem, 2 adds, RoPE 20 B/elem on q and k,
    # SiLU·mul 10 B per ffn element, the attention output's transpose (no GQA expansion: K = H)
    ew = 2 * 36 * 8 + 2 * 6 * 8 + 20 * (2 + 2) * 4 + 10 * 16 + 2 * 2 * 2 * 4
    t_ew = (3 * ew * 2 * 4 + 40 * 4 * 10) / 1e9
    t_opt = 96 * 1472 / 1e9                                        # foreach AdamW
    assert est.compute_s == pytest.approx(t_gemm + t_attn + t_ew + t_opt, rel=1e-12)
    assert est.mfu == pytest.approx(est.model_flops_per_step / (est.step_time_s * 1e12))  # datasheet peak


#: grouped-query attention (K < H) so the recomputed wk's width is the kv heads' K·d = 2·2
TINY_GQA = ModelSpec("tiny-gqa", num_layers=2, hidden=8, num_heads=4, num_kv_heads=2, ffn=16, vocab_size=10,
                     seq_len=4)
UNIT = GpuKind("unit", hbm_gb=1, peak_bf16_tflops=1, hbm_gbps=1, intra_node_gbps=1, inter_node_gbps=1,
               gemm_efficiency=0.5, attention_efficiency=0.25, memory_efficiency=1.0)


def test_torchtitan_sac_policy_matches_hand_count():
    from gemcore.planner.cost import sac_recomputed_matmuls

    # forward order wq (8→8), wk (8→4), wv (8→4), wo (8→8), w1 (8→16), w3 (8→16), w2 (16→8): the
    # even-numbered wk, wo, w3 are recomputed — 32 + 64 + 128 = 224 weights, outputs 4 + 8 + 16 = 28
    assert sac_recomputed_matmuls(TINY_GQA, "every_other_mm") == (("wk", 8, 4), ("wo", 8, 8), ("w3", 8, 16))
    assert sac_recomputed_matmuls(TINY_GQA, "all_mm") == ()
    cluster = Cluster(UNIT, 1, 1)
    gemcore = estimate(TINY_GQA, cluster, Plan(ac="selective"), seq_len=4, global_batch=1)
    assert gemcore.plan.sac == "all_mm"                            # the default is gemcore's policy
    titan = estimate(TINY_GQA, cluster, Plan(ac="selective", sac="every_other_mm"), seq_len=4, global_batch=1)
    # selective keeps per token and layer: input h + out-proj h + q 8 + k,v 2·4 + attention out 8
    # + gate_up 2F + down h = 80 elements; the policy drops 28 of them. x 2 B x 4 tokens x 2 layers
    # (+ the fused loss's 4 B x 4 tokens x 10 vocab = 160). Compiled (fused) blocks also drop the
    # kept outputs only a residual add reads: wo's 8 unless recomputed, w2's 8
    assert gemcore.memory["activations"] == (80 - 8 - 8) * 2 * 4 * 2 + 160
    assert titan.memory["activations"] == (80 - 28 - 8) * 2 * 4 * 2 + 160
    eager = Cluster(UNIT, 1, 1, kernels="eager")                   # eager SAC caches every kept output
    assert estimate(TINY_GQA, eager, Plan(ac="selective"), seq_len=4,
                    global_batch=1).memory["activations"] == 80 * 2 * 4 * 2 + 12 * 4 * 10
    assert estimate(TINY_GQA, eager, Plan(ac="selective", sac="every_other_mm"), seq_len=4,
                    global_batch=1).memory["activations"] == (80 - 28) * 2 * 4 * 2 + 12 * 4 * 10
    # the backward runs their forward again: 2 x 224 FLOPs per token and layer, 4 tokens, 2 layers, at
    # the GEMM rate of the thinnest side (4 tokens: 4 / 68); elementwise recompute is the same
    t_recompute = 2 * 224 * 4 * 2 / (1e12 * 0.5 * (4 / 68))
    assert titan.compute_s - gemcore.compute_s == pytest.approx(t_recompute, rel=1e-9)
    assert titan.model_flops_per_step == gemcore.model_flops_per_step
    assert titan.to_dict()["sac"] == "every_other_mm"


def test_torchtitan_sac_policy_on_llama3_8b():
    from gemcore.planner.cost import sac_recomputed_matmuls

    model = PRESETS["llama3-8b"]
    # wk 4096·1024 + wo 4096·4096 + w3 4096·14336 = 79.7M of the block's 218.1M matmul weights:
    # one more forward of them is 2·79.7 / (6·218.1) = +12.2 % of the blocks' GEMM FLOPs
    recomputed = sum(i * o for _, i, o in sac_recomputed_matmuls(model, "every_other_mm"))
    block = sum(i * o for _, i, o in model.block_matmuls())
    assert recomputed == 4096 * (1024 + 4096 + 14336) and block == 218_103_808
    assert 2 * recomputed / (6 * block) == pytest.approx(0.1218, abs=1e-4)


def test_compiled_blocks_stack_is_fused_blocks_with_eager_loss_and_optimizer():
    fused = estimate(TINY, Cluster(UNIT, 1, 1, kernels="fused"), Plan(), seq_len=4, global_batch=1)
    eager = estimate(TINY, Cluster(UNIT, 1, 1, kernels="eager"), Plan(), seq_len=4, global_batch=1)
    blocks = estimate(TINY, Cluster(UNIT, 1, 1, kernels="compiled-blocks"), Plan(), seq_len=4, global_batch=1)
    # cross-entropy over 4 tokens x 10 logits: 40 B eager instead of 6 fused; AdamW over 1472 local
    # weights: foreach 96 B instead of fused 32 B; the blocks' bytes are the fused ones
    extra = ((40 - 6) * 4 * 10 + (96 - 32) * 1472) / 1e9
    assert blocks.compute_s - fused.compute_s == pytest.approx(extra, rel=1e-9)
    assert fused.compute_s < blocks.compute_s < eager.compute_s
    # the blocks keep what fused blocks keep; the eager loss holds 12 B per logit, the fused one 4
    assert blocks.memory["activations"] - fused.memory["activations"] == (12 - 4) * 4 * 10
    assert {k: v for k, v in blocks.memory.items() if k != "activations"} == {
        k: v for k, v in fused.memory.items() if k != "activations"}


def test_eager_bytes_count_rope_for_llms_only_and_one_kernel_norms():
    from gemcore.planner.cost import eager_elementwise_bytes

    gem = dataclasses.replace(TINY, kind="gem", length_law="uniform", num_candidates=1, embedding_rows=5)
    # RoPE in fp32 on q's and k's 2 + 2 heads of 4 dims, 20 B per element: GemModel has none
    assert eager_elementwise_bytes(TINY, False) - eager_elementwise_bytes(gem, False) == 20 * 4 * 4
    # two RMSNorms of 8 wide: 36 B per element with the fp32 upcast ops, 4 B as one kernel
    upcast, one = eager_elementwise_bytes(TINY, False), eager_elementwise_bytes(TINY, False, "one-kernel")
    assert upcast - one == 2 * (36 - 4) * 8
    eager = estimate(TINY, Cluster(UNIT, 1, 1, kernels="eager"), Plan(), seq_len=4, global_batch=1)
    torch_norm = estimate(TINY, Cluster(UNIT, 1, 1, kernels="eager-torch-rmsnorm"), Plan(), seq_len=4,
                          global_batch=1)
    # forward + backward (3x the forward's bytes) over 2 layers x 4 tokens at UNIT's 1 GB/s
    assert eager.compute_s - torch_norm.compute_s == pytest.approx(3 * 2 * 4 * (upcast - one) / 1e9, rel=1e-9)


@pytest.mark.parametrize("kwargs, words", [
    ({"ac": "selective", "sac": "odd_mm"}, "sac must be one of all_mm, every_other_mm"),
    ({"ac": "full", "sac": "every_other_mm"}, "sac=every_other_mm is a policy of ac=selective"),
])
def test_bad_sac_policy_names_the_option(kwargs, words):
    with pytest.raises(PlanError, match=words):
        Plan(**kwargs)
    with pytest.raises(ValueError, match="--degrees: sac"):
        Plan.parse(",".join(f"{k}={v}" for k, v in kwargs.items()))


def test_torchtitan_sac_policy_is_a_rule_for_dense_llms_only():
    plan = Plan(dp_shard=8, ac="selective", sac="every_other_mm")
    assert plan.violations(PRESETS["llama3-8b"], 8, 8) == []
    (problem,) = plan.violations(PRESETS["deepseek-v3"], 8, 8)
    assert "sac=every_other_mm is modelled for dense" in problem and "has experts" in problem
    assert "gem model" in plan.violations(PRESETS["gem-small"], 8, 8)[0]


def test_collective_uses_the_tier_bandwidth():
    cluster = make_cluster("h100", 16)
    plan = Plan(dp_shard=16)
    # 16 ranks over 2 nodes, 8 per node: min(NVLink 360, 8 NICs x 40) = 320 GB/s bus bandwidth;
    # a 1 GB ring takes NCCL's Simple protocol: 8.4 µs + 14 NVLink steps x 3.4 + 1 network step x 9.6
    assert ring_time(cluster, plan, MeshAxis.DP_SHARD, 1e9) == pytest.approx(
        1e9 * 15 / 16 / 320e9 + (8.4 + 14 * 3.4 + 9.6) * 1e-6)
    inside = Plan(dp_shard=2, tp=8)
    assert ring_time(cluster, inside, MeshAxis.TP, 1e9) == pytest.approx(1e9 * 7 / 8 / 360e9 + (8.4 + 7 * 3.4) * 1e-6)
    tiered = dataclasses.replace(make_cluster("h100", 32), tiers=(Tier("pod", 16, 1.0), Tier("spine", 32, 4.0)))
    # tp=1, dp_shard=32 spans both pods: 8 NICs x 40 GB/s / 4; 4 nodes: 28 NVLink and 3 network steps
    assert ring_time(tiered, Plan(dp_shard=32), MeshAxis.DP_SHARD, 1e9) == pytest.approx(
        1e9 * 31 / 32 / 80e9 + (8.4 + 28 * 3.4 + 3 * 9.6) * 1e-6)


def test_a_rings_latency_grows_with_its_steps_and_small_messages_take_the_low_latency_protocol():
    """NCCL's ring model: LL (3.6 µs + 0.47 per NVLink step + 2.7 per network step, 1/3 of the
    bandwidth inside a node, 1/4 across) for small messages, Simple (8.4 + 3.4 + 9.6 µs, all of
    it) for large ones; a measured latency (``--calibrate``) replaces the model."""
    one_node, many = make_cluster("h100", 8), make_cluster("h100", 1024)
    # 1 KiB all-gather inside a node: LL's 3.6 + 7 x 0.47 µs and three times the bytes' time
    bytes_s = 1024 * 7 / 8 / 360e9
    assert ring_time(one_node, Plan(dp_shard=8), MeshAxis.DP_SHARD, 1024) == pytest.approx(
        (3.6 + 7 * 0.47) * 1e-6 + 3 * bytes_s)
    # over 1,024 ranks on 128 nodes: 896 NVLink and 127 network steps, ~0.77 ms where one flat
    # per-collective latency (a flat latency per collective) said 40 µs
    small = ring_time(many, Plan(dp_shard=1024), MeshAxis.DP_SHARD, 1024)
    assert small == pytest.approx((3.6 + 896 * 0.47 + 127 * 2.7) * 1e-6, rel=1e-3)
    # an all-reduce steps twice as often
    assert ring_time(one_node, Plan(dp_replicate=8), MeshAxis.DP_REPLICATE, 1024, all_reduce=True) == pytest.approx(
        (3.6 + 14 * 0.47) * 1e-6 + 4 * 2 * bytes_s)
    measured = dataclasses.replace(one_node, gpu=dataclasses.replace(one_node.gpu, link_latency_s=1e-3))
    assert ring_time(measured, Plan(dp_shard=8), MeshAxis.DP_SHARD, 1024) == pytest.approx(1e-3 + bytes_s)


def test_recompute_trades_memory_for_time():
    model, cluster = PRESETS["llama3-8b"], make_cluster("h100", 8)
    runs = {ac: estimate(model, cluster, Plan(dp_shard=8, ac=ac), global_batch=8) for ac in ("none", "selective", "full")}
    assert runs["none"].memory["activations"] > runs["selective"].memory["activations"] > runs["full"].memory["activations"]
    assert runs["none"].step_time_s < runs["selective"].step_time_s < runs["full"].step_time_s


# ---------------------------------------------------------------------- search
@pytest.mark.parametrize("name, gpus", [("llama3-8b", 16), ("llama3-70b", 64), ("gem-small", 8),
                                        ("deepseek-v3", 256)])
def test_search_returns_feasible_plans_best_first(name, gpus):
    model, cluster = PRESETS[name], make_cluster("h100", gpus)
    batch = model.batch_per_gpu * gpus
    result = search(model, cluster, top=5, global_batch=batch)
    assert result.plans, result.rejected
    speeds = [e.tokens_per_s_per_gpu for e in result.plans]
    assert speeds == sorted(speeds, reverse=True)
    for est in result.plans:
        p = est.plan
        assert p.violations(model, batch, gpus) == []
        assert est.memory_total <= est.memory_limit
        assert p.num_gpus == gpus and model.num_heads % p.tp == 0 and model.num_kv_heads % p.tp == 0
        assert (p.dp_shard * p.cp) % p.ep == 0 and batch % (p.dp * p.mbs) == 0


def test_a_small_model_on_many_nodes_shards_within_a_few_nodes_and_replicates_across():
    """GEM-style topology awareness: gem-small's FSDP collectives are small, so over 1,024 ranks
    the ring's latency (1,023 steps, ~0.8 ms each collective) outweighs the memory that sharding
    wider saves. The search replicates across groups of nodes (HSDP); with one flat latency per
    collective it sharded over all 1,024."""
    model, cluster = PRESETS["gem-small"], make_cluster("h200", 1024)
    best = search(model, cluster, top=1).plans[0]
    assert best.plan.dp_replicate > 1 and best.plan.dp_shard < 1024
    flat = estimate(model, cluster, Plan(dp_shard=1024, mbs=best.plan.mbs))
    assert flat.step_time_s > 3 * best.step_time_s


def test_search_explains_a_model_that_cannot_fit():
    result = search(PRESETS["llama3-405b"], make_cluster("h100", 8), global_batch=8)
    assert result.plans == [] and result.rejected.get("memory", 0) > 0
    assert result.smallest_memory.memory_total > result.smallest_memory.memory_limit


def test_search_keeps_a_pipeline_that_fits_only_resharded():
    """The search's quick memory check must take the layout's least memory (resharded, full
    recompute), also for a pipeline, whose plans default to keeping the gathered weights."""
    from gemcore.planner.cost import MEMORY_HEADROOM

    model, layout = PRESETS["llama3-70b"], dict(pp=2, dp_shard=8)
    cluster = make_cluster("h100", 16, 8)
    need = {reshard: estimate(model, cluster, Plan(**layout, ac="full", reshard_after_forward=reshard),
                              global_batch=16).memory_total for reshard in (True, False)}
    assert need[True] < need[False]
    hbm_gb = (need[True] + need[False]) / 2 / MEMORY_HEADROOM / 1e9      # fits resharded only
    cluster = dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, hbm_gb=hbm_gb))
    result = search(model, cluster, global_batch=16, top=1,
                    allow=lambda p: (p.pp, p.dp_shard, p.tp, p.cp) == (2, 8, 1, 1))
    assert result.plans and result.plans[0].plan.reshard_after_forward is True


@pytest.mark.parametrize("name, gpus", [("llama3-8b", 8), ("gem-small", 4)])
def test_more_gpus_never_lower_total_throughput(name, gpus):
    """Weak scaling: doubling the GPUs (and the batch) never lowers the best total tokens/s."""
    model = PRESETS[name]
    totals = []
    for n in (gpus, 2 * gpus, 4 * gpus):
        best = search(model, make_cluster("h100", n), global_batch=model.batch_per_gpu * n * 2, top=1).plans[0]
        totals.append(best.tokens_per_s_per_gpu * n)
    assert totals == sorted(totals) and totals[-1] > totals[0] * 2 * 0.8


def test_tp_prefers_the_node():
    """With tp forced across nodes, the estimate is slower than the same tp inside a node."""
    model = PRESETS["llama3-70b"]
    fast = estimate(model, make_cluster("h100", 16, 8), Plan(dp_shard=2, tp=8, ac="full"), global_batch=16)
    slow = estimate(model, make_cluster("h100", 16, 4), Plan(dp_shard=2, tp=8, ac="full"), global_batch=16)
    assert "tp" in fast.intra_node and "tp" in slow.inter_node
    assert slow.comm_exposed_s["tp"] > 2 * fast.comm_exposed_s["tp"]  # 4 NICs x 40 vs NVLink 360 GB/s
    assert math.isclose(fast.compute_s, slow.compute_s)


def test_cluster_file_sets_power_limit_and_kernels():
    from pathlib import Path

    from gemcore.planner.cluster import load_cluster

    path = Path(__file__).resolve().parents[1] / "docs" / "planner" / "grand-teton-h100-500w.toml"
    cluster = load_cluster(path, gpus=8)
    assert cluster.gpu.power_limit_w == 500 and cluster.kernels == "fused"
    assert cluster.sustained_peak_flops == pytest.approx(989e12 * (500 / 700) ** (1 / 3))
    assert load_cluster(path, gpus=8, kernels="eager").kernels == "eager"
    with pytest.raises(ValueError, match="--kernels"):
        make_cluster("h100", 8, kernels="jit")
    model = PRESETS["llama3-8b"]
    fused = estimate(model, cluster, Plan(dp_shard=8, ac="selective"), global_batch=8)
    eager = estimate(model, dataclasses.replace(cluster, kernels="eager"), Plan(dp_shard=8, ac="selective"),
                     global_batch=8)
    assert eager.step_time_s > fused.step_time_s and eager.model_flops_per_step == fused.model_flops_per_step
