"""``--calibrate``: the measured rates, the dtype and host-overhead terms of the cost model."""
import dataclasses
import math

import pytest

from gemcore.planner.calibrate import calibrate_cluster, measure
from gemcore.planner.cluster import make_cluster
from gemcore.planner.cost import _gemm_shape_factor, estimate
from gemcore.planner.models import ModelSpec
from gemcore.planner.plan import Plan

SMALL = ModelSpec(name="small", kind="gem", num_layers=2, hidden=32, num_heads=4, num_kv_heads=4, ffn=64,
                  seq_len=24, length_law="uniform", num_candidates=2, embedding_rows=300)


def _cpu_cluster(**gpu_fields):
    cluster = make_cluster("h100", 1, 1, kernels="eager")
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, **gpu_fields))


def test_host_overhead_adds_on_a_synchronous_device_and_hides_behind_gpu_compute():
    plan = Plan(dp_shard=1, mbs=4)
    base = estimate(SMALL, _cpu_cluster(), plan, global_batch=8)
    fields = {"layer_overhead_s": 1e-3, "sequence_overhead_s": 2e-4, "step_overhead_s": 5e-3}
    sync = estimate(SMALL, _cpu_cluster(host_synchronous=True, **fields), plan, global_batch=8)
    n_mb, layers = 2, SMALL.num_layers
    expected = n_mb * layers * (1e-3 + plan.mbs * 2e-4) + 5e-3
    assert math.isclose(sync.step_time_s - base.step_time_s, expected, rel_tol=1e-9)
    assert math.isclose(sync.host_overhead_s, expected, rel_tol=1e-9)
    assert math.isclose(sum(sync.host_issue_s.values()), expected, rel_tol=1e-9)
    assert sync.host_issue_s["forward"] == pytest.approx(sync.host_issue_s["backward"])   # default share 0.5
    # asynchronous launches: only the part above the compute time shows
    tiny = {"layer_overhead_s": 1e-12, "sequence_overhead_s": 0.0, "step_overhead_s": 0.0}
    hidden = estimate(SMALL, _cpu_cluster(**tiny), plan, global_batch=8)
    assert hidden.step_time_s == base.step_time_s and hidden.host_overhead_s == 0.0
    # (the host's work after the backward outlasts the optimizer's GPU time: the step is the host's)
    shows = estimate(SMALL, _cpu_cluster(optimizer_host_s=1e-3, **fields), plan, global_batch=8)
    assert math.isclose(shows.step_time_s, base.step_time_s + expected - base.compute_s, rel_tol=1e-9)


def test_the_optimizers_per_layer_host_time_falls_after_the_backward_once_per_step():
    """``optimizer_layer_s`` is the part of ``layer_overhead_s`` spent on each layer's parameters
    after the backward: it moves from the forward/backward to the after phase, and with several
    micro-batches it is paid once, not once per micro-batch."""
    plan = Plan(dp_shard=1, mbs=4)
    fields = {"layer_overhead_s": 1e-3, "sequence_overhead_s": 2e-4, "step_overhead_s": 5e-3,
              "optimizer_host_s": 1e-3, "host_synchronous": True}
    without = estimate(SMALL, _cpu_cluster(**fields), plan, global_batch=8)
    moved = estimate(SMALL, _cpu_cluster(optimizer_layer_s=4e-4, **fields), plan, global_batch=8)
    n_mb, layers = without.num_microbatches, SMALL.num_layers
    assert n_mb == 2
    assert moved.host_issue_s["after"] == pytest.approx(without.host_issue_s["after"] + layers * 4e-4)
    before_backward_end = moved.host_issue_s["forward"] + moved.host_issue_s["backward"]
    assert before_backward_end == pytest.approx(without.host_issue_s["forward"] + without.host_issue_s["backward"]
                                                - n_mb * layers * 4e-4)
    assert without.host_overhead_s - moved.host_overhead_s == pytest.approx((n_mb - 1) * layers * 4e-4)
    # never more than the per-layer time it is a part of
    capped = estimate(SMALL, _cpu_cluster(**{**fields, "optimizer_layer_s": 1.0}), plan, global_batch=8)
    assert capped.host_issue_s["after"] == pytest.approx(without.host_issue_s["after"] + layers * 1e-3)


def test_a_calibrated_optimizer_rate_replaces_the_hbm_rate_for_the_optimizer_pass():
    """``optimizer_bytes_per_s`` (0 on datasheet kinds: the HBM rate) divides the optimizer's bytes:
    0 and the HBM rate give the same step, and on a synchronous device the step grows linearly in
    1 / rate (halving the rate adds what the rate before it took)."""
    plan = Plan(dp_shard=1, mbs=4)

    def step(rate):
        return estimate(SMALL, _cpu_cluster(optimizer_bytes_per_s=rate, host_synchronous=True), plan,
                        global_batch=8).step_time_s

    g = _cpu_cluster().gpu
    assert step(0.0) == pytest.approx(step(g.hbm_gbps * 1e9 * g.memory_efficiency), rel=1e-12)
    one, two, four = step(1e9), step(2e9), step(4e9)
    assert one - two == pytest.approx(2 * (two - four), rel=1e-9) and one > two > four > step(0.0)


def test_gpu_done_matches_a_phase_by_phase_simulation():
    """The closed form against the phase loop it stands for, on random host and GPU times."""
    import random

    from gemcore.planner.cost import gpu_done_s

    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 9)
        hf, gf, hb, gb, ha, ga = (rng.choice([0.0, rng.uniform(0, 3)]) for _ in range(6))
        host = gpu = 0.0
        for h, g in [(hf, gf), (hb, gb)] * n + [(ha, ga)]:
            host += h
            gpu = max(gpu + g, host)
        assert gpu_done_s(n, hf, gf, hb, gb, ha, ga) == pytest.approx(gpu, abs=1e-12)


def test_a_step_host_bound_in_its_forward_and_gpu_bound_in_its_backward_costs_both():
    """The middle model of the one-GPU timeline (one H200): the forward's host
    time plus the backward's GPU time plus the optimizer's, where max(host, GPU) would say less."""
    from gemcore.planner.cost import gpu_done_s

    mixed = gpu_done_s(1, 7.7, 3.0, 8.6, 14.1, 2.6, 0.7)      # ms; measured 22.6
    assert mixed == pytest.approx(7.7 + 14.1 + 0.7)
    assert mixed > max(7.7 + 8.6 + 2.6, 3.0 + 14.1 + 0.7) + 3.0   # max(host, GPU): 18.9
    assert gpu_done_s(1, 7.7, 2.0, 8.6, 3.0, 2.6, 0.7) == pytest.approx(7.7 + 8.6 + 2.6)   # host-bound
    assert gpu_done_s(3, 1.0, 5.0, 1.0, 9.0, 1.0, 2.0) == pytest.approx(3 * 14.0 + 2.0)     # GPU-bound


def _two_rank_cluster(**gpu_fields):
    cluster = make_cluster("h100", 2, 2, kernels="eager")
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, host_synchronous=True,
                                                                **gpu_fields))


def test_collectives_on_busy_cores_hide_behind_nothing():
    plan = Plan(dp_shard=2, mbs=4)
    # slow links, so the FSDP collectives are long against the compute
    slow = {"intra_node_gbps": 0.05, "inter_node_gbps": 0.05}
    hidden = estimate(SMALL, _two_rank_cluster(**slow), plan, global_batch=8)
    exposed = estimate(SMALL, _two_rank_cluster(comm_overlaps_compute=False, **slow), plan, global_batch=8)
    assert exposed.comm_exposed_s["fsdp"] > hidden.comm_exposed_s["fsdp"]
    assert exposed.compute_s == hidden.compute_s
    # fully exposed: per micro-batch, 2 all-gathers and 1 reduce-scatter of every layer's weights
    fast = {"intra_node_gbps": 1e6, "inter_node_gbps": 1e6, "link_latency_s": 1e-3}
    latency_only = estimate(SMALL, _two_rank_cluster(comm_overlaps_compute=False, **fast), plan,
                            global_batch=8)
    units = SMALL.num_layers + 1                 # a unit per block and the root (embeddings, head)
    n_mb = latency_only.num_microbatches
    assert latency_only.comm_exposed_s["fsdp"] == pytest.approx(n_mb * 3 * 1e-3 * units, rel=0.01)


def test_a_slower_reduce_scatter_scales_only_the_reduce_scatters():
    """``reduce_scatter_factor`` multiplies the reduce-scatters' bytes term, not the all-gathers'.
    Hand count, bf16, no latency, nothing hidden: FSDP per micro-batch gathers the weights twice
    (2 B each) and reduce-scatters them once in fp32 (4 B): 2·2 + 4 = 8 B units at factor 1 and
    2·2 + 3·4 = 16 at factor 3. TP with sequence parallelism: 2 all-gathers and 2 reduce-scatters of
    the activations per pass, 4 units and 2 + 2·3 = 8."""
    fields = {"comm_overlaps_compute": False, "link_latency_s": 1e-30, "activation_bytes": 2}
    fsdp, tp = Plan(dp_shard=2, mbs=4), Plan(dp_shard=1, tp=2, mbs=4)
    for plan, axis in ((fsdp, "fsdp"), (tp, "tp")):
        one = estimate(SMALL, _two_rank_cluster(**fields), plan, global_batch=8)
        three = estimate(SMALL, _two_rank_cluster(reduce_scatter_factor=3.0, **fields), plan, global_batch=8)
        assert one.comm_exposed_s[axis] > 0
        assert three.comm_exposed_s[axis] == pytest.approx(2 * one.comm_exposed_s[axis], rel=1e-9), axis
        assert three.compute_s == one.compute_s


def test_a_collectives_bytes_time_is_its_call_less_the_latency_and_at_least_a_hundredth_of_it():
    from gemcore.planner.calibrate import _bytes_seconds

    assert _bytes_seconds(1e-3, 5e-3) == pytest.approx(4e-3)
    # noise: the big call ran faster than the small one; the bytes still take a share of it, so a
    # ratio of two such figures stays a ratio of the calls (a 1e-9 s floor had read 62,760)
    ag, rs = _bytes_seconds(1.0e-3, 0.9e-3), _bytes_seconds(1.0e-3, 1.2e-3)
    assert ag == pytest.approx(0.9e-5) and rs == pytest.approx(2e-4)
    assert _bytes_seconds(0.0, 0.0) == 1e-9


def test_the_compute_parts_sum_to_the_compute():
    fields = {"layer_overhead_s": 1e-3, "step_overhead_s": 5e-3}
    for cluster, plan in ((_cpu_cluster(host_synchronous=True, **fields), Plan(dp_shard=1, mbs=2)),
                          (_two_rank_cluster(**fields), Plan(dp_shard=2, mbs=2, reshard_after_forward=True))):
        e = estimate(SMALL, cluster, plan, global_batch=8)
        parts = e.compute_parts_s
        assert set(parts) == {"gemm", "attention", "elementwise", "optimizer", "fsdp_copies", "host"}
        assert sum(parts.values()) == pytest.approx(e.compute_s, rel=1e-12)
        assert parts["host"] == e.host_overhead_s and all(v > 0 for k, v in parts.items() if k != "fsdp_copies")
        assert (parts["fsdp_copies"] > 0) == (plan.dp_shard > 1)


def test_a_calibrated_fsdp_copy_rate_costs_fsdp2s_copies_alone():
    """``fsdp_copy_bytes_per_s`` replaces the HBM rate for FSDP2's copies and nothing else. Hand
    count, bf16, FSDP resharding, one micro-batch of 8: every unsharded weight (the blocks' and the
    root's head) is copied out after each of 2 all-gathers (4 B) and copied in before 1
    reduce-scatter (14 B): 22 B a weight."""
    plan = Plan(dp_shard=2, mbs=8, reshard_after_forward=True)
    rates = [estimate(SMALL, _two_rank_cluster(fsdp_copy_bytes_per_s=r, activation_bytes=2), plan,
                      global_batch=16) for r in (1e9, 2e9)]
    assert rates[0].num_microbatches == 1
    weights = sum(SMALL.layer_params) + SMALL.head_params()
    assert rates[0].compute_s - rates[1].compute_s == pytest.approx(22 * weights * (1 / 1e9 - 1 / 2e9), rel=1e-9)
    # one process: no FSDP, no copies, whatever the rate
    alone = [estimate(SMALL, _cpu_cluster(fsdp_copy_bytes_per_s=r), Plan(dp_shard=1, mbs=8), global_batch=8)
             for r in (1e9, 2e9)]
    assert alone[0].step_time_s == alone[1].step_time_s


def test_data_parallel_overheads_count_only_when_sharded():
    fields = {"fsdp_layer_overhead_s": 2e-3, "data_parallel_step_overhead_s": 7e-3}
    plan = Plan(dp_shard=2, mbs=2)
    base = estimate(SMALL, _two_rank_cluster(), plan, global_batch=8)
    more = estimate(SMALL, _two_rank_cluster(**fields), plan, global_batch=8)
    n_mb = base.num_microbatches
    assert more.step_time_s - base.step_time_s == pytest.approx(n_mb * SMALL.num_layers * 2e-3 + 7e-3)
    one = estimate(SMALL, _cpu_cluster(host_synchronous=True, **fields), Plan(dp_shard=1, mbs=2),
                   global_batch=8)
    alone = estimate(SMALL, _cpu_cluster(host_synchronous=True), Plan(dp_shard=1, mbs=2), global_batch=8)
    assert one.step_time_s == alone.step_time_s


def test_fp32_run_moves_twice_the_activation_bytes():
    plan = Plan(dp_shard=1, mbs=4)
    bf16 = estimate(SMALL, _cpu_cluster(), plan, global_batch=8)
    fp32 = estimate(SMALL, _cpu_cluster(activation_bytes=4), plan, global_batch=8)
    assert math.isclose(fp32.memory["activations"], 2 * bf16.memory["activations"], rel_tol=1e-12)
    assert fp32.step_time_s > bf16.step_time_s
    assert fp32.memory["optimizer"] == bf16.memory["optimizer"]     # fp32 master state either way


def test_length_moments_override_is_used():
    plan = Plan(dp_shard=1, mbs=8)
    law = estimate(SMALL, _cpu_cluster(), plan, global_batch=8)
    mean, sq = SMALL.length_moments(24)
    same = estimate(SMALL, _cpu_cluster(), plan, global_batch=8, length_moments=(mean, sq))
    longer = estimate(SMALL, _cpu_cluster(), plan, global_batch=8, length_moments=(2 * mean, 4 * sq))
    assert same.step_time_s == law.step_time_s and longer.step_time_s > law.step_time_s
    assert longer.tokens_per_step == 2 * law.tokens_per_step


def test_measure_on_this_machine_and_calibrated_rates_reach_the_cost_model():
    rates = measure(SMALL, lengths=[1, 5, 26, 13], backend="reference", size=128)
    for key in ("gemm_flops", "gemm_flops_model", "attention_flops", "copy_bytes_per_s", "optimizer_bytes_per_s"):
        assert math.isfinite(rates[key]) and rates[key] > 0, key
    for key in ("sequence_overhead_s", "layer_overhead_s", "step_overhead_s"):
        assert 0 <= rates[key] < 1.0, key
    cuda = __import__("torch").cuda.is_available()                 # measure() runs on the GPU if any
    assert rates["activation_bytes"] == (2.0 if cuda else 4.0)      # bf16 there, fp32 on a CPU
    assert 0.0 <= rates["forward_host_share"] <= 1.0
    assert 0.0 <= rates["optimizer_host_s"] <= rates["step_overhead_s"]
    assert 0.0 <= rates["optimizer_layer_s"] <= rates["layer_overhead_s"]
    cluster, summary = calibrate_cluster(make_cluster("h100", 1, 1), rates, spec=SMALL)
    g = cluster.gpu
    assert g.activation_bytes == rates["activation_bytes"] and g.host_synchronous == (not cuda)
    # FSDP2 calls gloo synchronously: on CPU ranks nothing hides behind compute, spare cores or not
    assert g.comm_overlaps_compute == cuda
    assert g.layer_overhead_s == rates["layer_overhead_s"]
    assert g.optimizer_bytes_per_s == rates["optimizer_bytes_per_s"]
    assert (g.forward_host_share, g.optimizer_host_s, g.optimizer_layer_s) == (
        rates["forward_host_share"], rates["optimizer_host_s"], rates["optimizer_layer_s"])
    # the planner's GEMM rate at the model's thinnest side equals the rate measured on its layers
    rate = cluster.sustained_peak_flops * g.gemm_efficiency * _gemm_shape_factor(32)
    assert math.isclose(rate, rates["gemm_flops_model"], rel_tol=1e-9)
    assert math.isclose(g.attention_efficiency * cluster.peak_flops, rates["attention_flops"], rel_tol=1e-9)
    assert set(summary) == set(rates)


def test_attention_rate_is_capped_at_the_gemm_peak(monkeypatch):
    from gemcore.planner import calibrate

    # real lengths cost no more than as many length-1 sequences: the difference is timing noise.
    # The rate that leaves (counted FLOPs / 1e-3 of the time) must lie above any machine's GEMM
    # rate: at 1e-3 s it was ~195 GFLOP/s, which a fast, idle CPU's GEMM beats
    monkeypatch.setattr(calibrate, "_attention_times", lambda lengths, *args, **kwargs: 1e-9)
    rates = measure(SMALL, lengths=[1, 5, 26, 13], backend="reference", size=128)
    assert rates["attention_flops"] == rates["gemm_flops"]


def test_tiny_host_models_take_the_runs_attention_path_on_cuda_only():
    from gemcore.planner.calibrate import _tiny_shape

    # a CPU step is all host work: the narrowest model, one event
    assert _tiny_shape(SMALL, "cpu", [300, 500]) == {"heads": SMALL.num_heads, "head_dim": 2, "events": 1}
    # CUDA: the run's head dim (the Gluon kernels take 64 and 128 only) and its mean length,
    # one candidate included, at most 1024 events
    assert _tiny_shape(SMALL, "cuda", [300, 502]) == {"heads": 1, "head_dim": SMALL.qk_head_dim, "events": 400}
    assert _tiny_shape(SMALL, "cuda", [5000])["events"] == 1024
    assert _tiny_shape(None, "cuda", [1, 1]) == {"heads": 1, "head_dim": 128, "events": 1}


def test_tiny_steps_run_interleaved_on_a_history_of_the_given_length():
    import torch

    from gemcore.planner import calibrate

    one, three = calibrate._tiny_steps_s((1, 3), 1, "reference", "cpu", torch.float32, head_dim=16, events=40)
    for seconds, forward, after, wall_over_issued in (one, three):
        assert seconds > 0 and 0 < forward < 1 and 0 < after < 1
        assert 0.5 < wall_over_issued < 2.0      # a CPU step is all host work: its wall time is what it issued
    assert three[0] > one[0]                     # two more blocks of host work
    assert one[3] == three[3]                    # one figure for the rounds


def test_tiny_steps_alternate_the_models_round_by_round(monkeypatch):
    import torch

    from gemcore.parallel import apply
    from gemcore.planner import calibrate

    stepped = []                                 # parameters clipped, per step: which model stepped
    real_clip = apply.clip_grad_norm_

    def clip(parameters, max_norm):
        parameters = list(parameters)
        stepped.append(len(parameters))
        return real_clip(parameters, max_norm)

    def timed(fn, repeats, **_):
        for _ in range(repeats):
            fn()
        return 1.0

    monkeypatch.setattr(apply, "clip_grad_norm_", clip)
    monkeypatch.setattr(calibrate, "_timed", timed)
    monkeypatch.setattr(calibrate, "TINY_ROUNDS", 4)
    calibrate._tiny_steps_s((1, 2), 1, "reference", "cpu", torch.float32, head_dim=4, events=3)
    one, two = stepped[:2]
    assert one < two and stepped == [one, two] * 4


def test_phase_summary_leaves_out_the_warm_up_call_and_on_cuda_an_outlier():
    from gemcore.planner.calibrate import _phase_summary

    warm_up = (5.0, 1.0, 1.0)                         # compiling in the forward
    calls = [warm_up] + [(1.0, 2.0, 1.0)] * 4 + [(1.0, 2.0, 9.0)]   # one call lost its core after
    issued, forward, after = _phase_summary(calls, robust=False)
    assert (issued, forward, after) == pytest.approx((28 / 5, 5 / 28, 13 / 28))   # means: the outlier counts
    issued, forward, after = _phase_summary(calls, robust=True)
    assert (issued, forward, after) == pytest.approx((4.0, 0.25, 0.25))        # medians: it does not
    assert _phase_summary([warm_up], robust=False) == pytest.approx((7.0, 5 / 7, 1 / 7))   # nothing else
    assert _phase_summary([warm_up, (0.0, 0.0, 0.0)], robust=True) == (0.0, 0.0, 0.0)


def test_measure_rejects_an_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        measure(SMALL, lengths=[3], backend="nope", size=64)


class _Clock:
    """A fake ``time`` module: each call of the timed function advances it by the next duration."""

    def __init__(self, durations):
        self.now, self.durations, self.calls = 0.0, list(durations), 0

    def perf_counter(self):
        return self.now

    def call(self):
        self.now += self.durations[min(self.calls, len(self.durations) - 1)]
        self.calls += 1


def test_cpu_timing_is_the_mean_over_the_window_so_a_descheduled_call_counts(monkeypatch):
    import gemcore.planner.calibrate as cal

    # warm-up 1 s, then four 1 s calls and one that lost its core for 9 s more
    clock = _Clock([1.0, 1.0, 1.0, 10.0, 1.0, 1.0])
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal.torch.cuda, "is_available", lambda: False)   # a CPU, also on a GPU machine
    assert cal._timed(clock.call, repeats=5, budget_s=0.0) == pytest.approx(14.0 / 5)
    assert clock.calls == 6                               # exactly `repeats` after the warm-up
    # a GPU keeps the median: host jitter hides behind asynchronous launches
    clock = _Clock([1.0, 1.0, 1.0, 10.0, 1.0, 1.0])
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cal, "_sync", lambda: None)
    assert cal._timed(clock.call, repeats=5, budget_s=0.0) == 1.0


def test_cpu_window_spans_several_of_the_slowest_calls(monkeypatch):
    import gemcore.planner.calibrate as cal

    clock = _Clock([0.5, 0.1])            # warm-up 0.5 s, then 0.1 s a call
    monkeypatch.setattr(cal, "time", clock)
    monkeypatch.setattr(cal.torch.cuda, "is_available", lambda: False)
    per_call = cal._timed(clock.call, repeats=5, budget_s=0.3)
    assert per_call == pytest.approx(0.1)
    # the window is WINDOW_CALLS warm-up calls long (3 s), not the 0.3 s budget: 30 calls
    assert clock.calls - 1 == pytest.approx(cal.WINDOW_CALLS * 0.5 / 0.1, abs=1)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_rates_on_cuda_are_timed_in_device_time_not_by_the_launches():
    """Many tiny kernels: the host clock measures their launches, the device time only their
    execution (a few microseconds each), so the device time is well below the host's."""
    import torch

    from gemcore.planner.calibrate import _gpu_timed, _timed

    x = torch.ones(256, device="cuda")

    def launches():
        for _ in range(200):
            x.add_(1.0)

    host, device = _timed(launches), _gpu_timed(launches)
    assert 0 < device < 0.7 * host, (device, host)
