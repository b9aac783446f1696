"""Apply a :class:`Plan` to a GemModel with torch.distributed: DeviceMesh, DTensor TP, FSDP2.

Order (each step logs what it did): ``build_mesh`` -> ``apply_tp`` -> ``apply_ep`` ->
``apply_cp`` -> ``apply_ac`` -> ``apply_fsdp``.
TP goes first so FSDP2 shards the TP-sharded DTensors along the data-parallel mesh (2-D), as
TorchTitan does. Every step takes explicit arguments, not the config; the model file stays free
of parallelism code.

What is applied today: dp_shard (FSDP2 ``fully_shard``), dp_replicate x dp_shard (HSDP: a 2-D mesh
given to ``fully_shard``), tp (``parallelize_module`` with Colwise/RowwiseParallel on each MLP and
expert: gate_up column-wise, down row-wise; attention projections too when the block exposes
``head_dim``, otherwise attention stays replicated), ep (expert_parallel.py: experts spread over
the innermost ep ranks of dp_shard x cp, tokens moved by all-to-all), cp (context_parallel.py: each
cp rank runs the blocks on a cost-balanced contiguous share of the batch's rows; the cp ranks join
the FSDP mesh as ``dp_shard_cp``), ac (``checkpoint_wrapper`` per block: full recompute, or
selective checkpointing that keeps matmul and attention outputs, :func:`apply_ac`).
pp (pipeline_parallel.py: the blocks cut into pp x virtual_stages stages run by a
torch.distributed.pipelining schedule, each stage FSDP2-sharded over dp_shard (x cp) / HSDP); with pp
the order is ``build_mesh`` -> ``apply_tp``, ``apply_ep``, ``apply_cp`` and ``apply_ac`` (on the
whole model) -> ``apply_pipeline`` (split, then FSDP per stage, experts of ``apply_ep`` left out);
with cp each stage runs and passes on its cp rank's share of every micro-batch's rows.
Experts split over ep < dp_shard x cp (or beside dp_replicate) are FSDP2-sharded over the
remaining data-parallel ranks (:func:`expert_meshes`, :func:`shard_experts`), inside pipeline
stages too, and with tp each expert is TP-sharded as the dense MLPs are. ep beside cp: the ep
groups are the innermost ep ranks of dp_shard x cp (TorchTitan's mapping: with ep a multiple of
cp an ep group holds whole cp groups and ep / cp dp_shard ranks); cp ranks route their own rows.
Checkpoints hold the unsharded model's layout: :func:`tp_canonical_state` undoes the TP row
reorder of gate_up/qkv on save and redoes it on load.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from gemcore.planner.plan import MESH_ORDER, MeshAxis, Plan

log = logging.getLogger("gemcore.parallel.apply")


def check_supported(plan: Plan, num_blocks: int | None = None) -> list[str]:
    """What in ``plan`` this module cannot apply yet (empty: all of it). ``num_blocks``: the
    model's blocks, when known (pipeline stages hold equal block counts)."""
    missing = []
    if plan.sac != "all_mm":
        missing.append(f"sac={plan.sac} (the cost model's TorchTitan policy; apply_ac keeps every matmul "
                       f"output, sac=all_mm)")
    stages = plan.pp * plan.virtual_stages
    if plan.pp > 1 and num_blocks is not None and num_blocks % stages:
        missing.append(f"pp × virtual_stages = {plan.pp} × {plan.virtual_stages} = {stages} (must divide the "
                       f"model's blocks, model.num_blocks = {num_blocks})")
    return missing


def build_mesh(plan: Plan, device_type: str):
    """The DeviceMesh of ``plan`` with the :data:`MESH_ORDER` dimension names (size-1 dims kept)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(plan.degree(a) for a in MESH_ORDER)
    names = tuple(a.value for a in MESH_ORDER)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    log.info("mesh %s", dict(zip(names, shape)))
    return mesh


def data_parallel_coordinates(mesh) -> tuple[int, int]:
    """(rank, size) of this process among data-parallel readers (dp_replicate x dp_shard)."""
    rep, shard = mesh[MeshAxis.DP_REPLICATE.value], mesh[MeshAxis.DP_SHARD.value]
    return rep.get_local_rank() * shard.size() + shard.get_local_rank(), rep.size() * shard.size()


def _interleave_rows(weight: torch.Tensor, parts: int, shards: int) -> torch.Tensor:
    """Reorder output rows so that shard ``r`` of ``shards`` holds part-chunk ``r`` of every part.

    ``weight``: (parts * n, k) with ``parts`` stacked blocks (gate|up, or q|k|v). Column-wise TP
    gives rank r the r-th contiguous slice; after this reorder that slice is [p0_r, p1_r, ...], so
    the block's own ``chunk``/``view`` still finds its parts locally.
    """
    blocks = weight.chunk(parts, dim=0)                     # parts x (n, k)
    per = [b.chunk(shards, dim=0) for b in blocks]          # parts x shards x (n/shards, k)
    return torch.cat([per[p][r] for r in range(shards) for p in range(parts)], dim=0)


def _deinterleave_rows(weight: torch.Tensor, parts: int, shards: int) -> torch.Tensor:
    """The inverse of :func:`_interleave_rows`: back to ``parts`` stacked blocks."""
    pieces = weight.chunk(parts * shards, dim=0)            # [r][p] order
    return torch.cat([pieces[r * parts + p] for p in range(parts) for r in range(shards)], dim=0)


#: model attribute set by :func:`apply_tp`: {parameter name: (parts, shards)} of the weights whose
#: rows it reordered (checkpoints store them in the model's own order: :func:`tp_canonical_state`)
TP_ROWS_ATTR = "_gemcore_tp_reordered_rows"


def tp_canonical_state(model: nn.Module, model_state: dict, optim_state: dict, *, to_model: bool) -> None:
    """Undo (``to_model=False``: before saving) or redo (``to_model=True``: before loading) the
    row reorder of TP-sharded gate_up/qkv weights in a full state dict, in place, for the weights
    and their optimizer moments: a checkpoint of a tp run then holds the unsharded model's
    layout and loads into any other layout (and back)."""
    reordered = getattr(model, TP_ROWS_ATTR, None) or {}
    fix = _interleave_rows if to_model else _deinterleave_rows
    for name, (parts, shards) in reordered.items():
        if name in model_state:
            model_state[name] = fix(model_state[name], parts, shards)
        moments = (optim_state.get("state") or {}).get(name) or {}
        for key, value in moments.items():
            if isinstance(value, torch.Tensor) and value.dim() == 2:
                moments[key] = fix(value, parts, shards)


def apply_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Tensor parallelism over ``tp_mesh`` (1-D) on every block's MLP (and experts); attention too
    when blocks expose ``head_dim`` (then ``num_heads`` becomes the local head count)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    if tp == 1:
        return model
    from gemcore.kernels.mx_fsdp import unwrap_mx_weights, wrap_mx_weights

    # MX layers (precision mxfp8) run on their local shards (MXLinear's tensor-parallel forward).
    # Weights the precision policy wrapped for an MX all-gather under FSDP2 are split as plain
    # tensors, then wrapped again (each split one's local shard) at the end
    mx_gathered = unwrap_mx_weights(model)
    done, reordered = [], {}
    for i, block in enumerate(model.blocks):
        named = ([(f"blocks.{i}.mlp.experts.{j}", e) for j, e in enumerate(block.mlp.experts)]
                 if hasattr(block.mlp, "experts") else [(f"blocks.{i}.mlp", block.mlp)])
        for name, mlp in named:
            with torch.no_grad():
                mlp.gate_up.weight.copy_(_interleave_rows(mlp.gate_up.weight, 2, tp))
            reordered[f"{name}.gate_up.weight"] = (2, tp)
            parallelize_module(mlp, tp_mesh, {"gate_up": ColwiseParallel(), "down": RowwiseParallel()})
        done.append(f"blocks.{i}.mlp")
        if hasattr(block, "head_dim"):
            if block.num_heads % tp:
                raise ValueError(f"tp={tp} must divide the heads ({block.num_heads})")
            with torch.no_grad():
                block.qkv.weight.copy_(_interleave_rows(block.qkv.weight, 3, tp))
            reordered[f"blocks.{i}.qkv.weight"] = (3, tp)
            parallelize_module(block, tp_mesh, {"qkv": ColwiseParallel(), "out": RowwiseParallel()})
            block.num_heads //= tp
            done.append(f"blocks.{i}.attention")
    if mx_gathered:
        wrap_mx_weights(model)
    setattr(model, TP_ROWS_ATTR, reordered)
    log.info("tp=%d on %s", tp, ", ".join(done))
    return model


#: ops whose outputs ``ac=selective`` keeps (schema names, any overload): the matmuls (nn.Linear
#: dispatches mm / addmm, einsum and batched matmul bmm / baddbmm), fused attention (gemcore's
#: Triton op on GPU, PyTorch's SDPA kernels) and functional collectives (TP's DTensor
#: redistributions), so that the backward repeats neither a GEMM, attention nor a collective
SELECTIVE_AC_SAVE = frozenset({
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm",
    "gemcore::jagged_attention_fwd",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
    "_c10d_functional::all_reduce", "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::reduce_scatter_tensor", "_c10d_functional::all_to_all_single",
})


def selective_ac_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing policy: MUST_SAVE the outputs of :data:`SELECTIVE_AC_SAVE` ops,
    PREFER_RECOMPUTE everything else (norms, SiLU, products, adds, casts, copies, softmax)."""
    from torch.utils.checkpoint import CheckpointPolicy

    schema = getattr(op, "_schema", None)
    if schema is not None and schema.name in SELECTIVE_AC_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str) -> nn.Module:
    """Activation checkpointing of every block, as the planner costs it (cost.activation_elements).

    ``full``: each block keeps only its input and reruns its whole forward in the backward.
    ``selective``: PyTorch's selective activation checkpointing (``torch.utils.checkpoint`` with
    ``create_selective_checkpoint_contexts``) on each block: the outputs of the matmuls, of the
    attention op and of functional collectives are kept (:func:`selective_ac_policy`), the
    elementwise work between them (RMSNorm, SiLU·mul, residual adds, MoE routing and gathers; on
    CPU the reference attention's masked softmax between its two saved bmm) is recomputed.
    cp's K/V all-gather and ep's all-to-alls on gemcore.comms' torch backend are functional
    collectives and kept; on the mpi / ce backends the all-to-alls are not visible to the policy
    and run again in the backward.
    ``none``: nothing.
    """
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ValueError(f"ac must be none, selective or full, got {mode!r}")
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    extra = ({"context_fn": functools.partial(create_selective_checkpoint_contexts, selective_ac_policy)}
             if mode == "selective" else {})
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=True, **extra)
    log.info("activation checkpointing %s on every block%s", mode,
             " (matmul, attention and collective outputs kept)" if mode == "selective" else "")
    return model


def apply_fsdp(model: nn.Module, dp_mesh, *, reshard_after_forward: bool = True,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
               ignored_params: set | None = None) -> nn.Module:
    """FSDP2 over ``dp_mesh``: 1-D (dp_shard) shards; 2-D (dp_replicate, dp_shard) is HSDP.
    Each block is its own unit (gathered just in time), then the root holds embeddings and head.
    ``ignored_params`` (expert-parallel experts) stay local, outside FSDP."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    extra = {"ignored_params": ignored_params} if ignored_params else {}
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, **extra)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, **extra)
    log.info("fsdp over %s (%s)", dp_mesh.mesh_dim_names, "HSDP" if dp_mesh.ndim == 2 else "sharded")
    return model


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models whose parameters mix plain tensors and
    DTensors on different meshes (TP-sharded MLPs beside replicated norms, FSDP over both).

    Gradients are grouped by (expert-parallel group, mesh and placements, device, dtype); each
    group's local squared norms come from one fused ``torch._foreach_norm`` and are summed, and a
    DTensor group's sum is reduced over the mesh dimensions its gradients are sharded on (one
    collective per group, not per gradient). Expert-parallel parameters (``EP_GROUP_ATTR``) hold
    different experts on each rank: their sum is also all-reduced over their group. ``pp_group``:
    pipeline stages hold different parameters, so the squared total is summed over it (every rank
    gets the whole model's norm). Every gradient is then scaled by min(1, max_norm / total) with
    one ``torch._foreach_mul_`` per device and dtype. No host sync: the norm stays on the device.
    """
    import torch.distributed as dist

    from gemcore.parallel.expert import EP_GROUP_ATTR

    params = [p for p in parameters if p.grad is not None]
    if not params and pp_group is None:
        return torch.zeros(())
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(_norm_group(p.grad, getattr(p, EP_GROUP_ATTR, None)), []).append(p.grad)
    sums = []
    for (ep_group, mesh, placements, _, _), grads in groups.items():
        squared = _squared_sum(grads, mesh, placements)
        if ep_group is not None:   # different experts on each rank of the group
            dist.all_reduce(squared, group=ep_group)
        sums.append(squared)
    if sums:
        total_sq = torch.stack([s.to(sums[0].device) for s in sums]).sum()
    else:                          # a pipeline stage without gradients still joins the reduction
        total_sq = torch.zeros((), device=_group_device(pp_group))
    if pp_group is not None:
        dist.all_reduce(total_sq, group=pp_group)
    total = total_sq.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in _by_device_and_dtype([_local(p.grad) for p in params]):
        torch._foreach_mul_(group, scale.to(group[0].device))
    return total


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: in-place ops on it change the DTensor), else ``t``."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _norm_group(grad: torch.Tensor, ep_group) -> tuple:
    """(ep group, mesh, placements, device, dtype) of ``grad``: the gradients whose squared norms
    one fused kernel and one reduction can sum (mesh and placements None for a plain tensor)."""
    from torch.distributed.tensor import DTensor

    local = _local(grad)
    if isinstance(grad, DTensor):
        return ep_group, grad.device_mesh, tuple(grad.placements), local.device, local.dtype
    return ep_group, None, None, local.device, local.dtype


def _squared_sum(grads: list[torch.Tensor], mesh, placements) -> torch.Tensor:
    """0-dim float32: the sum of ``grads``' squared 2-norms over their whole mesh (one device and
    dtype; ``mesh`` None: plain tensors)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if mesh is not None and any(pl.is_partial() for pl in placements):
        raise ValueError(f"clip_grad_norm_: a gradient with pending partial sums ({placements})")
    norms = torch._foreach_norm([_local(g).detach() for g in grads], 2, dtype=torch.float32)
    local = torch.stack(norms).square().sum()
    if mesh is None:
        return local
    # a sharded mesh dimension (Shard, or FSDP-over-TP's _StridedShard) sums the squares
    summed = [Replicate() if pl.is_replicate() else Partial() for pl in placements]
    return DTensor.from_local(local.reshape(1), mesh, summed, run_check=False).full_tensor()[0]


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in groups of one device and dtype, the lists a fused ``torch._foreach_*``
    kernel takes in one launch."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


def _group_device(group) -> torch.device:
    """The device a process group's collectives take tensors on (NCCL: this rank's GPU)."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fsdp_mesh(mesh, plan: Plan):
    """The data-parallel mesh FSDP shards over: dp_shard, joined by cp when cp > 1 (flattened to
    ``dp_shard_cp``: cp ranks hold the same users but back-propagate different rows, so their
    gradients are summed with the data-parallel ones); with dp_replicate > 1 a 2-D HSDP mesh."""
    shard = MeshAxis.DP_SHARD.value
    if plan.cp > 1:
        mesh[(MeshAxis.DP_SHARD.value, MeshAxis.CP.value)]._flatten("dp_shard_cp")
        shard = "dp_shard_cp"
    return mesh[(MeshAxis.DP_REPLICATE.value, shard)] if plan.dp_replicate > 1 else mesh[shard]


def apply_plan(model: nn.Module, plan: Plan, device: torch.device, mesh=None, *,
               attention: dict | None = None) -> nn.Module:
    """Everything above, in the documented order, for a plan :func:`check_supported` accepts.
    ``attention``: ``activation``, ``scale``, ``norm`` of the model's attention hook (needed by
    context parallelism; default softmax with 1/sqrt(head_dim))."""
    missing = check_supported(plan)
    if missing:
        raise ValueError("parallelism: cannot apply " + "; ".join(missing))
    mesh = mesh if mesh is not None else build_mesh(plan, device.type)
    if plan.pp > 1:
        return _apply_pp(model, plan, device, mesh, attention)
    model, ignored = _apply_blocks(model, plan, device, mesh, attention)
    if plan.dp * plan.cp > 1:
        model = apply_fsdp(model, fsdp_mesh(mesh, plan), reshard_after_forward=plan.reshard_after_forward,
                           ignored_params=ignored)
    return model


def _apply_blocks(model: nn.Module, plan: Plan, device: torch.device, mesh, attention: dict | None):
    """(model, parameters to keep out of the blocks' FSDP2): the per-block layers of a plan on the
    whole model, with or without pp: tensor parallelism, experts (split over ep, FSDP2-sharded over
    the rest of the data-parallel ranks), context parallelism and activation checkpointing."""
    model = apply_tp(model.to(device), mesh[MeshAxis.TP.value])
    model, ignored, expert_mesh = _apply_ep(model, plan, mesh, device.type)
    model = _apply_cp(model, plan, mesh, attention)
    model = apply_ac(model, plan.ac)
    if expert_mesh is not None:
        shard_experts(model, expert_mesh, plan.dp * plan.cp, plan.reshard_after_forward)
    return model, ignored


def _apply_ep(model: nn.Module, plan: Plan, mesh, device_type: str):
    """(model, parameters to keep out of the blocks' FSDP2, expert FSDP mesh or None) after
    :func:`~gemcore.parallel.expert.apply_ep` when ``plan.ep > 1``."""
    if plan.ep == 1:
        return model, None, None
    from gemcore.parallel.expert import apply_ep, expert_parameters

    if plan.ep == plan.fsdp_size and plan.dp_replicate == 1:   # every expert on one rank
        group = mesh[MeshAxis.DP_SHARD.value].get_group() if plan.cp == 1 else expert_meshes(plan, device_type)[0]
        # the owner's gradient sums the tokens of all dp_shard x cp ranks, each back-propagating
        # cp x its rows' share of its data-parallel rank's loss (context_parallel.py): / (dp_shard x cp)
        model = apply_ep(model, group, plan.fsdp_size)
        ignored = expert_parameters(model)
        log.info("ep=%d over dp_shard x cp: %d expert parameters kept out of FSDP", plan.ep, len(ignored))
        return model, ignored, None
    # experts split over ep, sharded (FSDP2) over the other data-parallel ranks; their gradients
    # are divided there (shard_experts), not by apply_ep's hook
    ep_group, expert_mesh = expert_meshes(plan, device_type)
    return apply_ep(model, ep_group, 1), None, expert_mesh


def expert_meshes(plan: Plan, device_type: str):
    """(ep ProcessGroup, expert FSDP mesh): the data-parallel ranks of a pipeline stage and tp
    rank, dp_shard x cp (cp varying fastest, as in the main mesh), are cut into
    (dp_shard x cp / ep, ep), ep innermost, as the planner costs it and as TorchTitan borrows ep
    from dp_shard x cp. With ep a multiple of cp an ep group holds whole cp groups; with ep
    dividing cp it is part of one. Experts are split over ``ep`` and FSDP2-sharded over the
    ``dp_shard x cp / ep`` others (HSDP with dp_replicate). A second DeviceMesh over the same
    ranks (its own process groups): every rank calls this."""
    from torch.distributed.device_mesh import init_device_mesh

    rest = plan.fsdp_size // plan.ep
    names = ("e_pp", "e_dp_replicate", "e_dp_mod_ep", "e_ep", "e_tp")
    emesh = init_device_mesh(device_type, (plan.pp, plan.dp_replicate, rest, plan.ep, plan.tp),
                             mesh_dim_names=names)
    fsdp = emesh[("e_dp_replicate", "e_dp_mod_ep")] if plan.dp_replicate > 1 else emesh["e_dp_mod_ep"]
    log.info("ep=%d over the innermost ranks of dp_shard x cp; experts FSDP over %s", plan.ep,
             fsdp.mesh_dim_names)
    return emesh["e_ep"].get_group(), fsdp


def _apply_cp(model: nn.Module, plan: Plan, mesh, attention: dict | None) -> nn.Module:
    """:func:`~gemcore.parallel.context.apply_cp` over the cp mesh dimension when cp > 1."""
    if plan.cp == 1:
        return model
    from gemcore.parallel.context import apply_cp

    model = apply_cp(model, mesh[MeshAxis.CP.value].get_group(), **(attention or {}))
    log.info("cp=%d: blocks run on cost-balanced row shares, K/V carries all-gathered", plan.cp)
    return model


def shard_experts(model: nn.Module, expert_mesh, data_parallel_size: int, reshard_after_forward: bool) -> None:
    """FSDP2 on each expert-parallel MoE's experts over ``expert_mesh`` (before the blocks' FSDP2,
    which then leaves them alone). An expert's local gradient sums the ep group's tokens; FSDP2
    averages it over the expert mesh, and a post-reduce hook divides by the rest of
    ``data_parallel_size`` (dp_replicate x dp_shard x cp: with cp each rank back-propagates cp x
    its rows' share, as for the dense weights): the mean loss's gradient. (Not
    ``set_gradient_divide_factor``: its PREMUL_SUM reduction does not exist in gloo.) FSDP2 makes
    new parameters: the ep mark is set on them again."""
    from torch.distributed.fsdp import fully_shard

    from gemcore.parallel.expert import EP_GROUP_ATTR, ExpertParallelMoE

    for moe in [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]:
        mark = getattr(next(moe.experts.parameters()), EP_GROUP_ATTR)
        rest = data_parallel_size / expert_mesh.size()
        for expert in moe.experts.values():   # one unit per expert (FSDP2 needs a module with forward)
            fully_shard(expert, mesh=expert_mesh, reshard_after_forward=reshard_after_forward)
            expert.set_all_reduce_hook(lambda reduced, r=rest: reduced.div_(r))
        for p in moe.experts.parameters():
            setattr(p, EP_GROUP_ATTR, mark)


def _apply_pp(model: nn.Module, plan: Plan, device: torch.device, mesh, attention: dict | None) -> nn.Module:
    """pp > 1 (beside any of dp_shard/dp_replicate, tp, ep, cp): tensor parallelism, experts,
    context parallelism and recompute per block on the whole model, then split into stages with
    FSDP2 per stage over dp_shard (x cp) (pipeline_parallel.py); the tensors passed between stages
    are the blocks' replicated (plain) outputs, with cp this rank's share of each micro-batch's rows
    (a stage's cp peers run the same schedule, so their collectives pair up)."""
    from gemcore.parallel.pipeline import apply_pipeline

    # as without pp; each stage's MoE layers exchange over their ep group
    model, ignored = _apply_blocks(model, plan, device, mesh, attention)
    dp_mesh = fsdp_mesh(mesh, plan) if plan.dp * plan.cp > 1 else None
    pipelined = apply_pipeline(model, pp_mesh=mesh[MeshAxis.PP.value], fsdp_mesh=dp_mesh, schedule=plan.schedule,
                               virtual_stages=plan.virtual_stages, mbs=plan.mbs, device=device,
                               reshard_after_forward=plan.reshard_after_forward, ignored_params=ignored)
    setattr(pipelined, TP_ROWS_ATTR, getattr(model, TP_ROWS_ATTR, {}))   # same parameter names
    return pipelined


__all__ = ["build_mesh", "apply_tp", "apply_ac", "apply_fsdp", "apply_plan", "check_supported",
           "clip_grad_norm_", "fsdp_mesh",
           "data_parallel_coordinates"]
