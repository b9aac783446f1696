"""The full (unsharded) training state of a model that torch.distributed spreads over ranks, in
the one-process model's names and layout: :func:`full_state_dict` to save, :func:`load_full_state_dict`
to restore, whatever the plan (FSDP2/HSDP, tp, cp, ep, pp).

Three things on top of ``torch.distributed.checkpoint``'s full state dict:

* pipeline stages each hold their own parameters: their states are merged on pp rank 0
  (:func:`~gemcore.parallel.pipeline.pipeline_state_dict`);
* tensor parallelism reorders the rows of gate_up/qkv weights: undone on save, redone on load
  (:func:`~gemcore.parallel.apply.tp_canonical_state`);
* parameters that differ between ranks (expert-parallel experts), below.

``torch.distributed.checkpoint``'s full state dict gathers FSDP2 shards and TP DTensors into whole
tensors, but a plain parameter that each rank holds differently (rank r's experts
``[r·E/ep, (r+1)·E/ep)``, see :mod:`gemcore.parallel.expert`) comes back from one rank
only. Those parameters carry globally unique names (``...mlp.experts.{global index}...``), so:

* :func:`gather_rank_local_state` (a collective over the default group) adds every rank's such
  parameters, and their optimizer state, to the full state on global rank 0: the checkpoint then
  holds every expert under the same names as a one-process model's;
* :func:`own_share` keeps, of such a full state, what this rank's model holds, for loading.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gemcore.parallel.expert import EP_GROUP_ATTR

#: module-name parts that wrappers insert and full state dicts leave out
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _fqn(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t``; a DTensor (experts FSDP2-sharded over their replicas) is gathered
    first: a collective over its mesh, in the same parameter order on every rank."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()


def has_rank_local(model: nn.Module) -> bool:
    return any(hasattr(p, EP_GROUP_ATTR) for p in model.parameters())


def gather_rank_local_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                            optim_state: dict) -> None:
    """Merge every rank's rank-local parameters (model and optimizer entries, by name, moved to
    the host) into ``model_state`` / ``optim_state`` on global rank 0, in place; other ranks'
    dicts are left as they are. Collective over the default group: every rank calls it."""
    groups = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    local_model, local_optim = {}, {}
    for name, p in model.named_parameters():
        if not hasattr(p, EP_GROUP_ATTR):
            continue
        fqn = _fqn(name)
        local_model[fqn] = _whole(p)
        state = optimizer.state.get(p)
        if state:
            local_optim[fqn] = ({k: _whole(v) if isinstance(v, torch.Tensor) else v
                                 for k, v in state.items()}, groups.get(id(p), 0))
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((local_model, local_optim), parts, dst=0)
    if dist.get_rank() != 0:
        return
    for part_model, part_optim in parts:
        for fqn, value in part_model.items():
            model_state.setdefault(fqn, value)
        for fqn, (state, g) in part_optim.items():
            optim_state.setdefault("state", {}).setdefault(fqn, state)
            names = optim_state["param_groups"][g]["params"]
            if fqn not in names:
                names.append(fqn)


def own_share(model: nn.Module, model_state: dict, optim_state: dict) -> tuple[dict, dict]:
    """The entries of a full (merged) state that ``model`` holds: model keys and optimizer states
    and param-group names of this rank's parameters only."""
    own = set(model.state_dict())
    mine = {k: v for k, v in model_state.items() if k in own}
    groups = [{**g, "params": [p for p in g["params"] if p in own]} for g in optim_state["param_groups"]]
    optim: dict[str, Any] = {"state": {k: v for k, v in optim_state["state"].items() if k in own},
                             "param_groups": groups}
    return mine, optim


def full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model state, optimizer state) of the whole model on global rank 0 (other ranks' dicts are
    empty or partial: only rank 0 writes). A collective: every rank calls it."""
    from torch.distributed.checkpoint import state_dict as dcp

    from gemcore.parallel.apply import tp_canonical_state
    from gemcore.parallel.pipeline import is_pipelined, pipeline_state_dict

    if is_pipelined(model):
        model_state, optim_state = pipeline_state_dict(model, optimizer)
    else:
        options = dcp.StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = dcp.get_state_dict(model, optimizer, options=options)
    if has_rank_local(model):   # experts: each rank holds its own
        gather_rank_local_state(model, optimizer, model_state, optim_state)
    if model_state:
        tp_canonical_state(model, model_state, optim_state, to_model=False)
    return model_state, optim_state


def load_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict,
                         optim_state: dict) -> None:
    """Restore a :func:`full_state_dict` (every rank passes the whole state; each takes its share).
    Modifies the given dicts (TP row order)."""
    from torch.distributed.checkpoint import state_dict as dcp

    from gemcore.parallel.apply import tp_canonical_state
    from gemcore.parallel.pipeline import is_pipelined

    tp_canonical_state(model, model_state, optim_state, to_model=True)
    if is_pipelined(model) or has_rank_local(model):   # stages / experts: this rank's names only
        model_state, optim_state = own_share(model, model_state, optim_state)
    dcp.set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=dcp.StateDictOptions(full_state_dict=True))


__all__ = ["full_state_dict", "load_full_state_dict", "gather_rank_local_state", "own_share", "has_rank_local"]
