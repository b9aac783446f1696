"""First-principles cost model of one training step under a plan: memory per GPU and step time.

Every formula is written out in docs/planner.md; the names below follow it. Units: bytes,
seconds, FLOPs. The slowest pipeline stage is modelled (it holds ``ceil(layers / pp)`` layers).

Memory (mixed-precision AdamW, FSDP2 keeps fp32 sharded weights):
  parameters 4 B, gradients 4 B, optimizer 8 B per locally held weight, plus the bf16 weights
  FSDP gathers (two layers in flight, or the whole stage when ``reshard_after_forward`` is off)
  and their unsharded gradients; activations per token and layer from the tensors autograd
  saves (``activation_elements``); logits for the LM loss; the GEM item table is sharded over
  every GPU with a row-wise Adagrad state.
Time: GEMM FLOPs / (peak x gemm efficiency) + attention FLOPs / (peak x attention efficiency) +
  elementwise bytes / (HBM bandwidth x efficiency); collectives from message sizes and the bus
  bandwidth of the network tier their group spans; overlap rules per dimension; the pipeline
  bubble ``(pp - 1) / virtual_stages`` micro-batch times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from gemcore.planner.cluster import Cluster
from gemcore.planner.models import ModelSpec
from gemcore.planner.plan import MESH_ORDER, MeshAxis, Plan

#: share of HBM a plan may use; the rest covers the CUDA context, NCCL buffers and fragmentation
MEMORY_HEADROOM = 0.9
BF16, FP32 = 2, 4
#: bytes per LM-head logit alive at once at the loss (measured on an H200, 16K × 128K logits, the
#: loss alone and inside a Llama 3 8B-shaped training step, tools/llama_memory_probe.py): eager ``cross_entropy(x.float())`` holds
#: the fp32 log-softmax output, its dense fp32 gradient and the input gradient during log-softmax's
#: backward (12; its isolated peak is 14 with the bf16 logits, which the model does not keep);
#: a fused (torch.compile) loss holds the bf16 logits and their bf16 gradient (4)
LOSS_PEAK_BYTES = {"fused": 4, "eager": 12}
#: AdamW step + gradient-norm traffic per local weight: read p, g, m, v, write p, m, v (fp32), read g
OPTIMIZER_BYTES_PER_PARAM = 32


@dataclass
class Estimate:
    """Cost of one plan. Memory in bytes per GPU; times in seconds per optimizer step."""

    plan: Plan
    memory: dict[str, float]          #: parameters, gradients, optimizer, activations
    memory_limit: float
    memory_total: float               #: bytes per GPU at the step's peak, what must fit (:func:`peak_memory`)
    compute_s: float
    comm_exposed_s: dict[str, float]  #: per mesh dimension (+ embedding, pp p2p)
    bubble_s: float
    step_time_s: float
    tokens_per_step: float
    model_flops_per_step: float
    num_gpus: int
    peak_flops: float
    num_microbatches: int
    intra_node: list[str]
    inter_node: list[str]
    notes: list[str] = field(default_factory=list)
    host_overhead_s: float = 0.0      #: size-independent host time counted in the step (calibrated)
    #: the host time issued per phase ("forward", "backward", "after": clipping and optimizer), of
    #: which host_overhead_s is what the device waits on
    host_issue_s: dict[str, float] = field(default_factory=dict)
    #: compute_s by part: "gemm", "attention", "elementwise" (all micro-batches), "optimizer",
    #: "fsdp_copies", "host" (= host_overhead_s); they sum to compute_s
    compute_parts_s: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.memory_total <= self.memory_limit

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.tokens_per_step / self.step_time_s / self.num_gpus

    @property
    def mfu(self) -> float:
        return self.model_flops_per_step / (self.step_time_s * self.num_gpus * self.peak_flops)

    def to_dict(self) -> dict:
        gb = 1e9
        return {
            **self.plan.degrees(),
            "mbs": self.plan.mbs, "ac": self.plan.ac, "sac": self.plan.sac, "schedule": self.plan.schedule,
            "virtual_stages": self.plan.virtual_stages,
            "reshard_after_forward": self.plan.reshard_after_forward,
            "num_microbatches": self.num_microbatches,
            "memory_gb": round(self.memory_total / gb, 3),
            "memory_breakdown_gb": {k: round(v / gb, 3) for k, v in self.memory.items()},
            "memory_limit_gb": round(self.memory_limit / gb, 3),
            "step_time_s": self.step_time_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": dict(self.comm_exposed_s),
            "bubble_s": self.bubble_s,
            "host_overhead_s": self.host_overhead_s,
            "host_issue_s": dict(self.host_issue_s),
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "intra_node": self.intra_node,
            "inter_node": self.inter_node,
            "notes": list(self.notes),
        }


# ---------------------------------------------------------------------- per-token counts
@lru_cache(maxsize=256)
def activation_elements(model: ModelSpec, ac: str, moe: bool, eager: bool = False) -> float:
    """Elements kept per token for one layer between its forward and backward (before dividing by
    tp), as gemcore's blocks run under ``apply_ac`` (checked against GemModel in
    tests/test_activation_checkpointing.py).

    none: attention — norm input h, qkv input h, q/k/v (hq·dqk + kv), attention output hq·dv
    (flash attention: its per-row log-sum-exp, hq fp32, is not counted); MLP — norm input h,
    gate_up input h, gate and up 2F, down input F, and with ``eager`` kernels the SiLU output F
    the product keeps (a fused SwiGLU recomputes it). Experts: the router's probabilities E, and
    each of the top-k copies its gathered input h, 3F (+F eager), its output h (kept for the
    routing-weight product) and the weighted output h (kept by the scatter-add); shared experts
    3F (+F eager).
    selective (PyTorch selective checkpointing, outputs of matmuls and of the attention op kept,
    everything else recomputed): the layer input h, q/k/v, attention output, out-projection output
    h, and per MLP (each expert copy, each shared expert) gate_up output 2F and down output h; the
    router's logits E.
    full: only the layer input h.
    """
    h = model.hidden
    qkv_out = model.num_heads * model.qk_head_dim + model.kv_dim + model.num_heads * model.value_head_dim
    if ac == "full":
        return h
    if moe:
        fe, routed, mlps = model.expert_ffn, model.top_k, model.top_k + model.shared_experts
    else:
        fe, routed, mlps = model.ffn, 0, 1
    router = model.num_experts if moe else 0
    if ac == "selective":
        return 2 * h + qkv_out + router + mlps * (2 * fe + h)
    swiglu = (4 if eager else 3) * fe
    if moe:
        mlp = 2 * h + router + routed * (3 * h + swiglu) + model.shared_experts * swiglu
    else:
        mlp = 2 * h + swiglu
    return 2 * h + qkv_out + mlp


def sac_recomputed_matmuls(model: ModelSpec, sac: str) -> tuple[tuple[str, int, int], ...]:
    """The matmuls of one layer (``ModelSpec.block_matmuls``: name, in, out) whose outputs
    ``ac=selective`` under policy ``sac`` does not keep: none for ``all_mm``; for ``every_other_mm``
    (TorchTitan's op-level SAC) the even-numbered ones in forward order — wk, wo, w3. Their outputs
    leave the saved activations (``out`` elements per token each) and the backward runs them again
    (2·in·out FLOPs per token each)."""
    if sac == "all_mm":
        return ()
    return tuple(mm for i, mm in enumerate(model.block_matmuls(), 1) if i % 2 == 0)


def rope_heads(model: ModelSpec) -> int:
    """Heads that RoPE rotates per token: q's and k's for LLMs; GEM-style models (GemModel) have no
    rotary position embedding."""
    return model.num_heads + model.num_kv_heads if model.kind == "llm" else 0


def residual_only_outputs(model: ModelSpec, sac: str, moe_frac: float) -> float:
    """Elements per token and layer of kept matmul outputs that only feed a residual add — the
    attention out-projection (wo) and a dense MLP's down projection (w2), unless ``sac`` recomputes
    them. Eager selective checkpointing caches every kept op's output; a compiled block's
    partitioner keeps only what the backward reads, and an add's backward reads neither (measured:
    TorchTitan's policy on Llama 3 8B blocks keeps 0.908 GB per layer compiled, 1.043 eager, at 16K
    tokens: one h-wide bf16 tensor, w2's output; tools/llama_memory_probe.py)."""
    recomputed = {name for name, _, _ in sac_recomputed_matmuls(model, sac)}
    wo = 0 if "wo" in recomputed else model.hidden
    w2 = 0 if "w2" in recomputed else model.hidden * (1 - moe_frac)   # experts' outputs are read
    return wo + w2


@lru_cache(maxsize=256)
def elementwise_elements(model: ModelSpec, moe: bool) -> float:
    """Elements read + written by the non-matmul kernels of one layer's forward per token when
    they are fused: two RMSNorms (4h), two residual adds (6h), RoPE on q and k (LLMs), SiLU·mul
    (3F per MLP), and for experts the token permutation there and back (4·top_k·h)."""
    h = model.hidden
    rope = 2 * rope_heads(model) * model.qk_head_dim
    if moe:
        mlp = 3 * model.expert_ffn * (model.top_k + model.shared_experts) + 4 * model.top_k * h
    else:
        mlp = 3 * model.ffn
    return 10 * h + rope + mlp


#: eager PyTorch bytes per element (reads + writes of every separate kernel, forward):
#: RMSNorm upcast to fp32: cast (2+4), pow (4+4), mean (4), x·rsqrt (4+4), cast back (4+2), ·weight (2+2)
EAGER_NORM_BYTES = 36
#: RMSNorm as one kernel (torch's ``F.rms_norm`` on CUDA): read x, write y (2+2)
ONE_KERNEL_NORM_BYTES = 4
#: RoPE as a complex product in fp32: cast (2+4), complex multiply (4+4), cast back (4+2)
EAGER_ROPE_BYTES = 20
#: SiLU (2+2), then · up (2+2+2)
EAGER_SWIGLU_BYTES = 10
#: residual add (2+2+2)
ADD_BYTES = 6


@lru_cache(maxsize=256)
def eager_elementwise_bytes(model: ModelSpec, moe: bool, norm: str = "upcast") -> float:
    """Bytes one layer's forward moves per token through unfused eager PyTorch kernels: the fused
    count's tensors, but each op a kernel of its own (``EAGER_*``; ``norm="one-kernel"``: each
    RMSNorm one kernel), plus the grouped-query K/V expansion to all heads and the attention
    output's transpose back to (T, hidden)."""
    h, d, H, K = model.hidden, model.qk_head_dim, model.num_heads, model.num_kv_heads
    norms = 2 * (ONE_KERNEL_NORM_BYTES if norm == "one-kernel" else EAGER_NORM_BYTES) * h
    rope = EAGER_ROPE_BYTES * rope_heads(model) * d
    if moe:
        mlp = (EAGER_SWIGLU_BYTES * model.expert_ffn * (model.top_k + model.shared_experts)
               + BF16 * 4 * model.top_k * h)
    else:
        mlp = EAGER_SWIGLU_BYTES * model.ffn
    kv_expand = 2 * BF16 * (K * d + H * d) if K < H else 0       # repeat_kv of k and v
    transpose = 2 * BF16 * H * model.value_head_dim
    return norms + 2 * ADD_BYTES * h + rope + mlp + kv_expand + transpose


#: cross-entropy bytes per logit, forward + backward: fused (read the bf16 logits twice, write their
#: gradient) or eager (fp32 upcast, log-softmax, its backward on a dense fp32 gradient, cast back)
LOSS_BYTES = {"fused": 6, "eager": 40}
#: optimizer bytes per local weight: fused AdamW + norm (read p, g, m, v; write p, m, v; read g), or
#: foreach AdamW, one pass per op (lerp, mul, addcmul, sqrt, div, add, addcdiv, decay) + clipping
OPTIMIZER_BYTES = {"fused": OPTIMIZER_BYTES_PER_PARAM, "eager": 96}
#: FSDP2 copies per unsharded weight: all-gather copy-out of bf16 weights (2+2); reduce-scatter:
#: bf16 gradient cast to fp32 (2+4) and copy-in to the flat buffer (4+4)
FSDP_GATHER_COPY_BYTES = 4
FSDP_SCATTER_COPY_BYTES = 14
#: flash attention: backward recomputes QKᵀ (5 matmuls vs the forward's 2), so forward + backward
#: does 3.5x the forward's FLOPs while model FLOPs count 3x
ATTENTION_HW_FACTOR = 3.5 / 3.0


# ---------------------------------------------------------------------- collectives
def ring_time(cluster: Cluster, plan: Plan, axis: MeshAxis, full_bytes: float, *,
              all_reduce: bool = False, reduce_scatter: bool = False, size: int | None = None,
              stride: int | None = None) -> float:
    """All-gather of ``full_bytes`` (the unsharded size) over ``axis``'s groups: S·(n−1)/n / busbw
    plus the ring's latency (:meth:`Cluster.ring_collective_s`); a reduce-scatter's bytes term times
    the GPU's ``reduce_scatter_factor``; an all-reduce's twice the all-gather's."""
    n = size if size is not None else plan.degree(axis)
    if n <= 1 or full_bytes <= 0:
        return 0.0
    stride = stride if stride is not None else plan.stride(axis)
    bw, _, _ = cluster.group_bandwidth(n, stride)
    factor = 2.0 if all_reduce else (cluster.gpu.reduce_scatter_factor if reduce_scatter else 1.0)
    return cluster.ring_collective_s(n, stride, factor * full_bytes * (n - 1) / n / bw, all_reduce=all_reduce)


def all_to_all_time(cluster: Cluster, n: int, stride: int, send_bytes: float) -> float:
    """All-to-all where each rank sends ``send_bytes`` in all, spread evenly over ``n`` ranks:
    the share for ranks in other nodes goes at the rank's own NIC rate, the rest over NVLink."""
    if n <= 1 or send_bytes <= 0:
        return 0.0
    bw_intra, latency, inside = cluster.group_bandwidth(n, stride)
    if inside:
        return send_bytes * (n - 1) / n / bw_intra + latency
    per_node = max(1, cluster.gpus_per_node // stride)
    remote = send_bytes * (n - per_node) / n / cluster.nic_bandwidth(n * stride)
    local = send_bytes * (per_node - 1) / n / (cluster.gpu.intra_node_gbps * cluster.gpu.link_efficiency * 1e9)
    return max(remote, local) + latency


def placement(plan: Plan, cluster: Cluster) -> tuple[list[str], list[str]]:
    """Mesh dimensions (degree > 1) whose groups sit inside a node, and those that cross nodes."""
    inside, across = [], []
    for axis in (*MESH_ORDER, MeshAxis.EP):
        n = plan.degree(axis)
        if n > 1:
            (inside if n * plan.stride(axis) <= cluster.gpus_per_node else across).append(axis.value)
    return inside, across


def training_state_bytes(model: ModelSpec, plan: Plan) -> float:
    """Lower bound of memory per GPU: the 16 B/weight of the sharded training state alone."""
    dense_layers, expert_layers = model.layer_params
    frac = math.ceil(model.num_layers / plan.pp) / model.num_layers
    if model.kind == "llm":
        edge = (max(model.embedding_params(), model.head_params()) if plan.pp > 1
                else model.embedding_params() + model.head_params())
    else:
        edge = model.head_params()
    return 4 * FP32 * ((dense_layers + expert_layers) * frac + edge) / (plan.tp * plan.fsdp_size)


# ---------------------------------------------------------------------- the estimate
def estimate(model: ModelSpec, cluster: Cluster, plan: Plan, *, seq_len: int | None = None,
             global_batch: int | None = None,
             length_moments: tuple[float, float] | None = None) -> Estimate:
    """Memory and step time of ``plan``. The plan must satisfy :meth:`Plan.violations` first.
    ``length_moments``: (E[L], E[L²]) of the sequences (incl. candidates) of one particular batch,
    instead of the model's length law (to predict a step that ran)."""
    S = seq_len or model.seq_len
    B = global_batch or model.default_global_batch(cluster.gpus, S)
    g = cluster.gpu
    mean_len, mean_sq = length_moments or model.length_moments(S)
    tp, cp, pp, ep, v = plan.tp, plan.cp, plan.pp, plan.ep, plan.virtual_stages
    n_mb = max(1, plan.num_microbatches(B))
    L = model.num_layers
    stage_layers = math.ceil(L / pp)
    frac = stage_layers / L                        # share of each layer kind on the slowest stage
    moe_frac = model.moe_layers / L
    h = model.hidden
    act_b = g.activation_bytes                    # bf16 (2) on GPUs; fp32 (4) for a CPU run
    dtype_scale = act_b / BF16

    dense_layers, expert_layers = model.layer_params
    stage_dense = dense_layers * frac
    stage_expert = expert_layers * frac
    llm = model.kind == "llm"
    # LLM embedding and head are FSDP + vocab-parallel weights; on a pipeline the first stage holds
    # the embedding, the last the head: the heavier of the two counts.
    if llm:
        edge = (max(model.embedding_params(), model.head_params()) if pp > 1
                else model.embedding_params() + model.head_params())
    else:
        edge = model.head_params()
    local_dense = (stage_dense + edge) / (tp * plan.fsdp_size)
    local_expert = stage_expert / (tp * plan.fsdp_size)
    local = local_dense + local_expert

    # ------------------------------------------------------------------ memory
    memory = {"parameters": FP32 * local, "gradients": FP32 * local, "optimizer": 2 * FP32 * local,
              "activations": 0.0}
    # what an FSDP all-gather leaves on a GPU: its tp shard of the dense weights and of its own
    # ep group's experts (each GPU holds 1/ep of the experts; FSDP shards those over f/ep)
    layer_weights = (dense_layers + expert_layers / ep) / L / tp
    if plan.fsdp_size > 1:
        if plan.reshard_after_forward:
            gathered = 2 * layer_weights          # the current layer and the prefetched next one
            # FSDP2 does not reshard the root (embeddings, head) after the forward: the backward
            # needs it at once, so its weights stay gathered from the head's forward to the end
            memory["parameters"] += act_b * (gathered + edge / tp)
            memory["gradients"] += act_b * gathered
        else:                                     # gathered once per step, grads accumulate unsharded
            memory["parameters"] += act_b * (stage_dense + stage_expert / ep + edge) / tp
            memory["gradients"] += FP32 * (stage_dense + stage_expert / ep + edge) / tp
    if model.kind == "gem":                       # item table: fp32 rows + row-wise Adagrad, over all GPUs
        rows = model.embedding_rows
        memory["parameters"] += FP32 * rows * h / cluster.gpus
        memory["optimizer"] += FP32 * rows / cluster.gpus
        memory["gradients"] += FP32 * h * B * mean_len / cluster.gpus

    tokens_mb = plan.mbs * mean_len / cp          # tokens of one micro-batch on one GPU
    stack = cluster.kernel_stack
    eager = stack.blocks == "eager"
    recomputed_mms = sac_recomputed_matmuls(model, plan.sac)     # empty unless ac=selective (Plan)
    act_token = ((1 - moe_frac) * activation_elements(model, plan.ac, False, eager)
                 + moe_frac * activation_elements(model, plan.ac, True, eager)
                 - sum(out for _, _, out in recomputed_mms))
    if plan.ac == "selective" and not eager:      # compiled blocks drop the outputs no backward reads
        act_token -= residual_only_outputs(model, plan.sac, moe_frac)
    per_layer_mb = act_b * act_token * tokens_mb / tp
    if plan.ac == "full":                         # the layer being recomputed holds everything
        recompute_layer = act_b * tokens_mb / tp * activation_elements(model, "none", model.is_moe, eager)
    else:
        recompute_layer = 0.0
    in_flight = 1.0
    if pp > 1:                                    # the first stage holds pp micro-batches (1F1B)
        in_flight = pp * (1 + (pp - 1) / (pp * v)) if v > 1 else pp
        in_flight = min(in_flight, n_mb * 1.0)
    acts = stage_layers * per_layer_mb * in_flight + recompute_layer
    if llm:
        logits = LOSS_PEAK_BYTES[stack.loss] * tokens_mb * model.vocab_size / tp
        acts = max(acts, stage_layers * per_layer_mb + logits) if pp > 1 else acts + logits
    memory["activations"] = acts

    # ------------------------------------------------------------------ compute per micro-batch
    active_stage = (model.active_matmul_params() - model.head_params()) * frac
    head = model.head_params()                    # on the last stage (pp > 1) or with the rest
    gemm_flops = 6.0 * (active_stage + head) * tokens_mb / tp
    # selective AC's recomputed matmuls run their forward again (dense layers only: Plan's rule)
    recompute_gemm_flops = (2.0 * sum(i * o for _, i, o in recomputed_mms) * stage_layers
                            * tokens_mb / tp)
    attn_flops = (3.0 * model.num_heads * (model.qk_head_dim + model.value_head_dim) * stage_layers
                  * plan.mbs * mean_sq / (tp * cp))
    if eager:                                     # byte counts are bf16's; fp32 moves twice as much
        ew_fwd = dtype_scale * ((1 - moe_frac) * eager_elementwise_bytes(model, False, stack.norm)
                  + moe_frac * eager_elementwise_bytes(model, True, stack.norm))
        last_add = dtype_scale * ADD_BYTES * h
    else:
        ew_fwd = act_b * ((1 - moe_frac) * elementwise_elements(model, False)
                         + moe_frac * elementwise_elements(model, True))
        last_add = act_b * 3 * h
    layer_tokens = stage_layers * tokens_mb / tp
    ew_bytes = 3 * ew_fwd * layer_tokens          # forward + backward (2x forward)
    recompute = {"none": 0.0, "selective": 0.0, "full": 1.0 / 3.0}[plan.ac]
    if plan.ac == "selective":                    # the elementwise forward up to the down projection
        ew_bytes += (ew_fwd - last_add) * layer_tokens   # runs again (norms, RoPE, SiLU·mul, routing)
    if plan.ac == "full":
        ew_bytes += ew_fwd * layer_tokens
    if llm:                                       # the loss (last stage; modelled with the rest)
        ew_bytes += dtype_scale * LOSS_BYTES[stack.loss] * tokens_mb * model.vocab_size / tp
    shape = _gemm_shape_factor(min(tokens_mb, h, model.num_heads * model.qk_head_dim / tp,
                                   (model.expert_ffn if model.is_moe else model.ffn) / tp))
    peak = cluster.sustained_peak_flops
    hbm = g.hbm_gbps * 1e9 * g.memory_efficiency
    t_gemm = (gemm_flops * (1 + recompute) + recompute_gemm_flops) / (peak * g.gemm_efficiency * shape)
    t_attn = attn_flops * ATTENTION_HW_FACTOR * (1 + recompute) / (peak * g.attention_efficiency)
    t_ew = ew_bytes / hbm
    compute_mb = t_gemm + t_attn + t_ew
    bwd_mb = compute_mb * 2 / 3

    # ------------------------------------------------------------------ communication per micro-batch
    passes = 3 if plan.ac == "full" else 2        # forward, backward (+ forward again)
    act_bytes = act_b * tokens_mb * h              # one activation tensor of the micro-batch
    # each pass: 2 all-gathers (into attention and the MLP) and 2 reduce-scatters (out of them)
    tp_mb = stage_layers * passes * 2 * (ring_time(cluster, plan, MeshAxis.TP, act_bytes)
                                         + ring_time(cluster, plan, MeshAxis.TP, act_bytes, reduce_scatter=True))
    kv_chunk = act_b * tokens_mb * model.kv_dim
    cp_layer = (cp - 1) * (kv_chunk * (1 + 2 + (1 if plan.ac == "full" else 0))
                           / cluster.group_bandwidth(cp, plan.stride(MeshAxis.CP))[0]) if cp > 1 else 0.0
    overlap = g.comm_overlaps_compute
    cp_mb = stage_layers * (max(0.0, cp_layer - t_attn / stage_layers) if overlap else cp_layer)
    ep_mb = 0.0
    if model.is_moe and ep > 1:
        send = act_b * tokens_mb / tp * model.top_k * h
        ep_mb = (model.moe_layers * frac) * 2 * passes * all_to_all_time(cluster, ep, tp, send)
    pp_mb = 0.0
    if pp > 1:
        bw, latency, _ = cluster.group_bandwidth(2, plan.stride(MeshAxis.PP))
        pp_mb = 2 * v * (act_bytes / tp / bw + latency)   # activations forward, gradients back

    # FSDP over dp_shard x cp (dense) and dp_shard x cp / ep (experts), stride tp / tp·ep; an
    # expert group gathers its own 1/ep of the experts
    dense_w = (stage_dense + edge) / tp
    expert_w = stage_expert / (tp * ep)

    def fsdp(weight_count: float, n: int, stride: int, gathers: int, scatters: int, units: float) -> float:
        """``units`` FSDP2 units (one collective each) holding ``weight_count`` between them."""
        if n <= 1 or units <= 0:
            return 0.0
        unit = weight_count / units
        gather = ring_time(cluster, plan, MeshAxis.DP_SHARD, act_b * unit, size=n, stride=stride)
        scatter = ring_time(cluster, plan, MeshAxis.DP_SHARD, FP32 * unit, reduce_scatter=True,
                            size=n, stride=stride)
        return units * (gathers * gather + scatters * scatter)

    fsdp_n, fsdp_exp_n = plan.fsdp_size, plan.fsdp_size // ep
    # one unit per block, plus the root (embeddings, head) on the stages that hold them
    dense_units = stage_layers + (1 if edge else 0)
    expert_units = math.ceil(model.moe_layers * frac) if model.is_moe else 0
    # FSDP2's copy-out after each all-gather and cast + copy-in before each reduce-scatter (HBM)
    copied = (dense_w if fsdp_n > 1 else 0.0) + (expert_w if fsdp_exp_n > 1 else 0.0)
    n_gather, n_scatter = (2 * n_mb, n_mb) if plan.reshard_after_forward else (1, 1)
    fsdp_copy_s = dtype_scale * copied * (n_gather * FSDP_GATHER_COPY_BYTES
                                          + n_scatter * FSDP_SCATTER_COPY_BYTES) / (g.fsdp_copy_bytes_per_s or hbm)
    if plan.reshard_after_forward:
        fsdp_per_mb = (fsdp(dense_w, fsdp_n, tp, 2, 1, dense_units)
                       + fsdp(expert_w, fsdp_exp_n, tp * ep, 2, 1, expert_units))
        fsdp_exposed = n_mb * (max(fsdp_per_mb - compute_mb, fsdp_per_mb / stage_layers)
                               if overlap else fsdp_per_mb)
    else:
        gather = (fsdp(dense_w, fsdp_n, tp, 1, 0, dense_units)
                  + fsdp(expert_w, fsdp_exp_n, tp * ep, 1, 0, expert_units))
        scatter = (fsdp(dense_w, fsdp_n, tp, 0, 1, dense_units)
                   + fsdp(expert_w, fsdp_exp_n, tp * ep, 0, 1, expert_units))
        fsdp_exposed = (max(gather - compute_mb / 3, gather / stage_layers)
                        + max(scatter - bwd_mb, scatter / stage_layers)) if overlap else gather + scatter
    replicate = ring_time(cluster, plan, MeshAxis.DP_REPLICATE, FP32 * local, all_reduce=True)
    replicate_exposed = ((max(replicate - bwd_mb, replicate / stage_layers) if overlap else replicate)
                         if replicate else 0.0)
    embed_exposed = 0.0
    if model.kind == "gem":                       # looked-up rows there, their gradients back
        send = act_b * h * B * mean_len / cluster.gpus
        embed_exposed = 2 * all_to_all_time(cluster, cluster.gpus, 1, send)

    optimizer_s = OPTIMIZER_BYTES[stack.optimizer] * local / (g.optimizer_bytes_per_s or hbm)
    t_mb = compute_mb + tp_mb + cp_mb + ep_mb + pp_mb
    bubble = (pp - 1) / v * t_mb if pp > 1 else 0.0
    comm = {"tp": n_mb * tp_mb, "cp": n_mb * cp_mb, "ep": n_mb * ep_mb, "pp": n_mb * pp_mb,
            "fsdp": fsdp_exposed, "dp_replicate": replicate_exposed, "embedding": embed_exposed}
    compute_total = n_mb * compute_mb + optimizer_s + fsdp_copy_s
    # size-independent host time (Python, dispatcher, per-sequence attention loops): it adds to the
    # compute on a synchronous device; on a GPU only what the asynchronous launches cannot hide
    # shows, phase by phase (:func:`gpu_done_s`)
    optimizer_layer = min(g.optimizer_layer_s, g.layer_overhead_s)  # a part of the per-layer time
    layers_host = n_mb * stage_layers * (g.layer_overhead_s - optimizer_layer + plan.mbs * g.sequence_overhead_s
                                         + (g.fsdp_layer_overhead_s if fsdp_n > 1 else 0.0))
    optimizer_host = min(g.optimizer_host_s, g.step_overhead_s)     # a part of the per-step time
    after_host = (optimizer_host + stage_layers * optimizer_layer
                  + (g.data_parallel_step_overhead_s if cluster.gpus > 1 else 0.0))
    issue_host = layers_host + g.step_overhead_s - optimizer_host
    share = g.forward_host_share
    host_issue = {"forward": share * issue_host, "backward": (1 - share) * issue_host, "after": after_host}
    if g.host_synchronous:
        host_exposed = issue_host + after_host
    else:
        host_exposed = gpu_done_s(n_mb, host_issue["forward"] / n_mb, compute_mb / 3,
                                  host_issue["backward"] / n_mb, bwd_mb, after_host,
                                  optimizer_s + fsdp_copy_s) - compute_total
        # a GPU-bound step: the difference is rounding (it had printed "-8.88e-16 s" of host time)
        host_exposed = host_exposed if host_exposed > 1e-9 * compute_total else 0.0
    compute_total += host_exposed
    step = compute_total + sum(comm.values()) + bubble

    tokens_step = B * mean_len
    model_flops = (6.0 * model.active_matmul_params() * tokens_step
                   + 3.0 * model.num_heads * (model.qk_head_dim + model.value_head_dim) * L * B * mean_sq)
    inside, across = placement(plan, cluster)
    return Estimate(plan=plan, memory=memory, memory_limit=MEMORY_HEADROOM * cluster.hbm_bytes,
                    memory_total=peak_memory(memory, accumulates=n_mb > 1 or pp > 1),
                    compute_s=compute_total, comm_exposed_s={k: t for k, t in comm.items() if t},
                    bubble_s=bubble, step_time_s=step, tokens_per_step=tokens_step,
                    model_flops_per_step=model_flops, num_gpus=cluster.gpus, peak_flops=cluster.peak_flops,
                    num_microbatches=n_mb, intra_node=inside, inter_node=across,
                    host_overhead_s=host_exposed, host_issue_s=host_issue,
                    compute_parts_s={"gemm": n_mb * t_gemm, "attention": n_mb * t_attn,
                                     "elementwise": n_mb * t_ew, "optimizer": optimizer_s,
                                     "fsdp_copies": fsdp_copy_s, "host": host_exposed})


def gpu_done_s(n_mb: int, host_fwd: float, gpu_fwd: float, host_bwd: float, gpu_bwd: float,
               host_after: float, gpu_after: float) -> float:
    """Seconds from a step's start until its GPU work is done, when the host issues ``n_mb``
    micro-batches' forward and backward (``host_fwd``, ``host_bwd`` s each) and then the work after
    the backward (``host_after``: clipping, optimizer), and the GPU runs them in ``gpu_*`` s.

    Launches are asynchronous, so each phase ends on the GPU at max(the GPU's end of the phase
    before + this phase's GPU time, the moment the host has issued it). The GPU's lag behind the
    host then moves per phase as lag ← max(lag + gpu − host, 0); over identical micro-batches that
    has the closed form below (s: the lag's growth per micro-batch, c: what one backward leaves).
    A step that is host-bound in its forward and GPU-bound in its backward costs the forward's
    host time plus the backward's GPU time: more than max(host, GPU) over the whole step.
    """
    s = (gpu_fwd - host_fwd) + (gpu_bwd - host_bwd)
    c = max(gpu_bwd - host_bwd, 0.0)
    lag = max(n_mb * s, c + (n_mb - 1) * max(s, 0.0)) if n_mb else 0.0
    issued = n_mb * (host_fwd + host_bwd)
    return max(issued + lag + gpu_after, issued + host_after)


def peak_memory(memory: dict[str, float], *, accumulates: bool) -> float:
    """Bytes per GPU at the step's peak from ``estimate``'s split. With one micro-batch per step the
    gradients and the activations never peak together: the backward frees each layer's activations
    as it makes that layer's gradients (k layers in: k layers' gradients + L − k layers' activations,
    largest at an end), so the peak holds the larger of the two. When gradients ``accumulate`` over
    micro-batches (or pipeline stages hold several), they sit beside the next one's activations."""
    both = memory["gradients"] + memory["activations"]
    held = both if accumulates else max(memory["gradients"], memory["activations"])
    return memory["parameters"] + memory["optimizer"] + held


def _gemm_shape_factor(smallest_dim: float) -> float:
    """GEMMs with a thin side run below the large-GEMM rate: d / (d + 64)."""
    return smallest_dim / (smallest_dim + 64.0)


__all__ = ["Estimate", "estimate", "peak_memory", "training_state_bytes", "activation_elements",
           "sac_recomputed_matmuls", "residual_only_outputs", "rope_heads", "elementwise_elements",
           "eager_elementwise_bytes", "ring_time", "all_to_all_time", "placement", "MEMORY_HEADROOM"]
