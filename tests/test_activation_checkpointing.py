"""Activation checkpointing as the planner costs it (gemcore/parallel/apply.py ``apply_ac``):
selective and full give the no-AC loss and gradients, selective runs no matmul again in the
backward, and the bytes one block keeps for its backward match ``cost.activation_elements``."""
from __future__ import annotations

import copy
import gc
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gemcore.config import AttentionConfig, ModelConfig
from gemcore.data import JaggedDataset
from gemcore.kernels.jagged_attention import make_attention
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference
from gemcore.model import Block, GemModel
from gemcore.parallel import apply as apply_mod
from gemcore.parallel.apply import apply_ac
from gemcore.planner.cost import activation_elements
from gemcore.planner.models import ModelSpec

HIDDEN, HEADS, RATIO, EXPERTS, TOP_K = 64, 4, 4, 4, 2


def build_model(experts: int) -> GemModel:
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=50, hidden=32, num_heads=4, num_blocks=3, mlp_ratio=2,
                      moe_experts=experts, moe_top_k=2)
    return GemModel(cfg, make_attention(AttentionConfig(), backend="reference"))


def batch():
    rng = np.random.default_rng(0)
    lengths, cands = np.array([0, 1, 7, 12, 3]), np.array([2, 1, 3, 1, 2])
    t, c = int(lengths.sum()), int(cands.sum())
    data = JaggedDataset.from_arrays(
        lengths=lengths, cand_lengths=cands, item_ids=rng.integers(0, 50, t), actions=rng.integers(0, 4, t),
        time_gaps=rng.exponential(100, t), cand_ids=rng.integers(0, 50, c),
        labels=rng.integers(0, 2, c).astype(np.float32))
    return data.__getitems__(range(len(lengths)))


class CountOps(TorchDispatchMode):
    """Counts the calls of the ops named in ``names``."""

    def __init__(self, names):
        super().__init__()
        self.names, self.count = names, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in self.names
        return func(*args, **(kwargs or {}))


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm")


def loss_grads_and_backward_matmuls(model: GemModel, b):
    loss = model.loss(b)
    counter = CountOps(MATMULS)
    with counter:
        loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()], counter.count


# ------------------------------------------------------------------ (a) same loss and gradients
@pytest.mark.parametrize("experts", [0, EXPERTS])
def test_checkpointing_keeps_loss_and_gradients_and_selective_recomputes_no_matmul(experts):
    b = batch()
    base = build_model(experts)
    loss0, grads0, mm0 = loss_grads_and_backward_matmuls(copy.deepcopy(base), b)
    counts = {}
    for mode in ("selective", "full"):
        loss, grads, counts[mode] = loss_grads_and_backward_matmuls(apply_ac(copy.deepcopy(base), mode), b)
        assert torch.equal(loss, loss0), mode
        assert len(grads) == len(grads0)
        for g, g0 in zip(grads, grads0):
            torch.testing.assert_close(g, g0, rtol=0, atol=1e-6)
    # selective keeps every matmul output: its backward runs exactly the matmuls of no AC (the
    # old every-second-block full recompute ran one block's forward matmuls again); full reruns all
    assert counts["selective"] == mm0
    assert counts["full"] > mm0


def test_every_block_is_checkpointed_by_the_selective_policy():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.utils.checkpoint import CheckpointPolicy

    model = apply_ac(build_model(0), "selective")
    assert all(isinstance(block, CheckpointWrapper) for block in model.blocks)
    policy = apply_mod.selective_ac_policy
    for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
        assert policy(None, op) == CheckpointPolicy.MUST_SAVE
    for op in (torch.ops.aten.silu.default, torch.ops.aten.mul.Tensor, torch.ops.aten.add.Tensor,
               torch.ops.aten.rsqrt.default, torch.ops.aten._softmax.default):
        assert policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE
    assert "gemcore::jagged_attention_fwd" in apply_mod.SELECTIVE_AC_SAVE


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and triton")
def test_triton_attention_op_is_saved():
    from torch.utils.checkpoint import CheckpointPolicy

    pytest.importorskip("triton")
    import gemcore.kernels.jagged_attention_triton  # noqa: F401  registers the op

    op = torch.ops.gemcore.jagged_attention_fwd.default
    assert apply_mod.selective_ac_policy(None, op) == CheckpointPolicy.MUST_SAVE


# ------------------------------------------------------------------ (b) memory against the cost model
@torch.library.custom_op("gemcore_test::flash_like_attention", mutates_args=())
def flash_like_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor,
                         num_targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stand-in for the GPU's ``gemcore::jagged_attention_fwd``: one op returning (out, lse),
    keeping q, k, v, out and lse (T, H) for its backward, no (L x L) tensor."""
    out = jagged_attention_reference(q, k, v, offsets, causal=True, num_targets=num_targets)
    return out, q.new_zeros(q.shape[0], q.shape[1], dtype=torch.float32)


@flash_like_attention.register_fake
def _(q, k, v, offsets, num_targets):
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def _save(ctx, inputs, output):
    q, k, v, offsets, num_targets = inputs
    ctx.save_for_backward(q, k, v, offsets, num_targets, *output)


def _backward(ctx, dout, _dlse):
    q, k, v, offsets, num_targets, _out, _lse = ctx.saved_tensors
    with torch.enable_grad():
        qkv = [t.detach().requires_grad_() for t in (q, k, v)]
        out = jagged_attention_reference(*qkv, offsets, causal=True, num_targets=num_targets)
        return (*torch.autograd.grad(out, qkv, dout), None, None)


flash_like_attention.register_autograd(_backward, setup_context=_save)


def flash_like_hook(q, k, v, offsets, *, causal=True, num_targets=None, max_seqlen=None):
    return flash_like_attention(q, k, v, offsets, num_targets)[0]


class LiveStorages(TorchDispatchMode):
    """Remembers every storage an op creates; :meth:`live_bytes` sums those still alive."""

    def __init__(self):
        super().__init__()
        self.refs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.refs += [weakref.ref(t.untyped_storage()) for t in tree_flatten(out)[0]
                      if isinstance(t, torch.Tensor)]
        return out

    def live_bytes(self, exclude) -> int:
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in exclude}
        alive = {s.data_ptr(): s.nbytes() for s in (r() for r in self.refs) if s is not None}
        return sum(n for ptr, n in alive.items() if ptr not in skip)


def kept_elements_per_token(mode: str, experts: int) -> float:
    """fp32 elements per token that one GemModel block keeps from its forward for its backward:
    its input and everything its forward made that is still alive once it returned (its output,
    parameters and the batch's offsets left out)."""
    torch.manual_seed(0)
    cfg = ModelConfig(num_items=10, hidden=HIDDEN, num_heads=HEADS, num_blocks=1, mlp_ratio=RATIO,
                      moe_experts=experts, moe_top_k=TOP_K)
    holder = nn.Module()
    holder.blocks = nn.ModuleList([Block(cfg, flash_like_hook)])
    block = apply_ac(holder, mode).blocks[0]
    lengths = torch.tensor([5, 40, 17, 64, 1, 33])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    targets = torch.full((len(lengths),), 2)
    T = int(offsets[-1])
    x0 = torch.randn(T, HIDDEN, requires_grad=True)
    tracker = LiveStorages()
    with tracker:
        y = block(x0 * 1.0, offsets, targets, int(lengths.max()))  # the input: made inside, held by AC only
    kept = tracker.live_bytes(exclude=[y, offsets, targets, *block.parameters()])
    y.sum().backward()                                               # runs (the recompute too)
    return kept / 4 / T


def gem_spec(experts: int) -> ModelSpec:
    """The planner's description of the measured block."""
    moe = {"num_experts": experts, "top_k": TOP_K, "moe_ffn": RATIO * HIDDEN} if experts else {}
    return ModelSpec("gem-block", kind="gem", num_layers=1, hidden=HIDDEN, num_heads=HEADS, num_kv_heads=HEADS,
                     ffn=RATIO * HIDDEN, seq_len=64, **moe)


@pytest.mark.parametrize("experts", [0, EXPERTS])
def test_kept_activations_match_the_cost_model(monkeypatch, experts):
    # the stand-in is saved like the GPU's attention op
    monkeypatch.setattr(apply_mod, "SELECTIVE_AC_SAVE",
                        apply_mod.SELECTIVE_AC_SAVE | {"gemcore_test::flash_like_attention"})
    measured = {mode: kept_elements_per_token(mode, experts) for mode in ("none", "selective", "full")}
    spec, moe = gem_spec(experts), bool(experts)
    model = {mode: activation_elements(spec, mode, moe, eager=True) for mode in measured}
    # on CPU F.rms_norm is decomposed and each norm also keeps x·(1/rms) (h) for the weight's
    # gradient; CUDA runs one fused op keeping only its input and 1/rms, as the model counts
    model["none"] += 2 * HIDDEN
    assert measured["full"] < measured["selective"] < measured["none"]
    # tolerance 3%: the model leaves out the attention's log-sum-exp (H per token), RMSNorm's
    # 1/rms (2 per token) and the router's top-k indices and normaliser (about 3·top_k per token)
    for mode in measured:
        assert measured[mode] == pytest.approx(model[mode], rel=0.03), (mode, measured, model)
    assert measured["selective"] / measured["none"] == pytest.approx(
        model["selective"] / model["none"], rel=0.03)


def backward_calls(block, x, names) -> dict[str, int]:
    """Calls of the ops ``names`` in the backward of ``block(x)`` checkpointed with gemcore's
    selective policy and with full recompute."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    calls = {}
    for mode in ("selective", "full"):
        ctx = dict(context_fn=lambda: create_selective_checkpoint_contexts(apply_mod.selective_ac_policy)) \
            if mode == "selective" else {}
        loss = checkpoint(block, x, use_reentrant=False, **ctx)
        counter = CountOps(names)
        with counter:
            loss.backward()
        calls[mode] = counter.count
    return calls


def test_selective_keeps_the_cp_all_gather(one_rank_group):
    """cp's K/V carry all-gather is a functional collective, so gemcore's selective policy keeps
    its output: the backward does not gather again (full recompute does, and must)."""
    from gemcore.parallel.context import gather_rows

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)

    def block(x):
        h = torch.relu(x @ w)
        return (gather_rows(h, [5], one_rank_group) @ w).sum()

    gathers = backward_calls(block, x, ("_c10d_functional::all_gather_into_tensor", "c10d::allgather_"))
    assert gathers == {"selective": 0, "full": 1}


def test_selective_keeps_the_torch_backend_all_to_all(one_rank_group):
    """ep's all-to-all through gemcore.comms' torch backend is a functional collective, so the
    selective policy keeps it: the backward exchanges once (the gradients), not twice."""
    from gemcore.comms import group_communicator
    from gemcore.comms.autograd import all_to_all

    comm = group_communicator(one_rank_group, check=False)
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(5, 8, requires_grad=True)

    def block(x):
        h = torch.relu(x @ w)
        return (all_to_all(comm, h, [5], [5]) @ w).sum()

    exchanges = backward_calls(block, x, ("_c10d_functional::all_to_all_single", "c10d::alltoall_base_"))
    assert exchanges == {"selective": 1, "full": 2}
