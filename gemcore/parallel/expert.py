"""Expert parallelism for GemModel's mixture of experts: each rank of the ep group holds
``num_experts / ep`` experts; tokens travel to their experts and back with two all-to-alls.

:class:`ExpertParallelMoE` replaces a block's :class:`gemcore.model.MoEMLP` (``apply_ep`` swaps the
module; model.py stays free of parallelism code). Forward, per MoE layer, on ``T`` local tokens:

1. route as MoEMLP does (softmax, top-k, renormalised weights), sort the ``T·k`` assignments by
   expert (experts of rank ``r`` are ``[r·E/ep, (r+1)·E/ep)``, so the sort also groups by rank);
2. exchange the per-expert counts (one small all-to-all), then the token rows themselves;
3. regroup the received rows by local expert, run each expert, undo the regrouping;
4. send the outputs back (the reverse all-to-all), weight them and add them to their tokens.

Every exchange goes through gemcore's communication layer: a :class:`gemcore.comms.Communicator`
over the ep ranks and :func:`gemcore.comms.autograd.all_to_all`, whose backward is the reverse
all-to-all of the gradient. ``apply_ep`` takes the ep ProcessGroup (a DeviceMesh dimension) and
gets its communicator from :func:`gemcore.comms.group_communicator`: the job's communicator
(``comms.init``, the ``comms.backend`` setting) split to the group's ranks when it is not
``torch`` (so under mpirun with ``comms.backend = "mpi"`` the expert all-to-alls run through MPI
while FSDP talks through gloo), else the torch backend over the group itself. A Communicator may
be passed instead of the group.

Gradients: an expert's gradient on its owner sums the contributions of every ep rank's tokens,
while FSDP averages dense gradients over the ``dp`` data-parallel ranks; a hook divides expert
gradients by ``dp`` so both are gradients of the same global mean loss (with context parallelism
``dp`` counts the cp ranks too: each back-propagates cp times its rows' share of the loss, and FSDP
averages over dp_shard x cp). Expert parameters are
left out of FSDP (``ignored_params``) and marked with ``EP_GROUP_ATTR`` so gradient clipping sums
their norms over the ep group.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from gemcore.comms import Communicator, current, group_communicator
from gemcore.comms.autograd import all_to_all

log = logging.getLogger("gemcore.parallel.expert")

#: attribute set on expert parameters: the group their experts are spread over (the ep
#: ProcessGroup when there is one, else the Communicator); gradient clipping sums norms over it
EP_GROUP_ATTR = "_gemcore_ep_group"


def ep_communicator(group, parent: Communicator | None = None) -> tuple[Communicator, object]:
    """The ep ranks as (communicator, what ``EP_GROUP_ATTR`` marks expert parameters with).

    ``group`` a ProcessGroup (None: the default group): :func:`gemcore.comms.group_communicator`
    ``(group, parent)`` (``parent`` default: the job's communicator, ``comms.current()``; with
    none, the torch backend over the group with ``check=False``) and the group itself. ``group`` a
    Communicator: itself, and its torch process group when it is a ``torch`` one (else itself).
    """
    if isinstance(group, Communicator):
        if group.backend == "torch" and hasattr(group, "group"):   # group None: the default group
            return group, group.group if group.group is not None else dist.group.WORLD
        return group, group
    if group is None or isinstance(group, dist.ProcessGroup):
        parent = parent if parent is not None else current()
        # without a job communicator no comms.check setting applies: the counts exchange already
        # makes the ranks' splits agree, so skip the two small signature/split collectives per call
        comm = group_communicator(group, parent, check=None if parent is not None else False)
        return comm, group if group is not None else dist.group.WORLD
    raise ValueError(f"group must be a torch.distributed ProcessGroup or a gemcore.comms Communicator, "
                     f"got {type(group).__name__}")


class ExpertParallelMoE(nn.Module):
    """The experts of ``moe`` (a MoEMLP: ``router``, ``experts``, ``top_k``) spread over the ep
    ranks: ``group`` is their ProcessGroup or a :class:`gemcore.comms.Communicator` (see
    :func:`ep_communicator`; ``comm`` is the parent a ProcessGroup's communicator is split from).
    ``data_parallel_size``: ranks over which dense gradients are averaged.

    x: (T, hidden) -> (T, hidden), the same function as ``moe`` on the same tokens.
    """

    def __init__(self, moe: nn.Module, group, data_parallel_size: int, *, comm: Communicator | None = None):
        super().__init__()
        dp = data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise ValueError(f"data_parallel_size must be a positive int, got {data_parallel_size!r}")
        self.comm, self.group = ep_communicator(group, comm)
        self.ep = self.comm.world_size
        self.ep_rank = self.comm.rank
        self.num_experts = len(moe.experts)
        if self.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the experts ({self.num_experts})")
        self.local_experts = self.num_experts // self.ep
        self.top_k = moe.top_k
        self.router = moe.router
        first = self.ep_rank * self.local_experts
        # keyed by the global expert index: names (and checkpoint keys) equal the unsplit MoE's
        self.experts = nn.ModuleDict({str(first + i): moe.experts[first + i] for i in range(self.local_experts)})
        scale = 1.0 / data_parallel_size
        for p in self.experts.parameters():
            setattr(p, EP_GROUP_ATTR, self.group)
            p.register_hook(lambda g, s=scale: g * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, k, ep, local = self.num_experts, self.top_k, self.ep, self.local_experts
        weights, expert = self.router(x).softmax(dim=-1).topk(k, dim=-1)        # (T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        order = flat_expert.argsort(stable=True)                                 # by expert = by rank
        rows = order // k
        counts = torch.bincount(flat_expert, minlength=E)                        # (E,) sent per expert
        per_rank = [local] * ep
        recv_counts = all_to_all(self.comm, counts, per_rank, per_rank)          # (ep * local,) [src][e]
        send_splits = counts.view(ep, local).sum(1).tolist()
        blocks = recv_counts.view(ep, local)
        recv_splits = blocks.sum(1).tolist()

        received = all_to_all(self.comm, x[rows], send_splits, recv_splits)     # (sum(recv_splits), hidden)
        # received rows are grouped [source][local expert]; regroup them [local expert][source]
        pieces = torch.arange(received.shape[0], device=x.device).split(blocks.reshape(-1).tolist())
        regroup = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)]
                            ) if pieces else received.new_empty(0, dtype=torch.long)
        grouped = received[regroup]
        outputs = []
        for e, chunk in zip(self.experts.values(), grouped.split(blocks.sum(0).tolist())):
            # every expert runs, on no rows too: FSDP2-sharded experts all-gather in their forward,
            # and every rank of their mesh must take part whatever it was routed
            outputs.append(e(chunk))
        done = torch.cat(outputs)[regroup.argsort()] if outputs else grouped
        back = all_to_all(self.comm, done, recv_splits, send_splits)            # (T·k, hidden)
        y = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, rows, y.to(x.dtype))


def apply_ep(model: nn.Module, group, data_parallel_size: int, *,
             comm: Communicator | None = None) -> nn.Module:
    """Replace every block's MoE (a module with ``router`` and ``experts``) by an
    :class:`ExpertParallelMoE`; raises if the model has no experts. Collective: every rank calls it.

    :param group: the ep ProcessGroup (e.g. ``mesh["dp_shard"].get_group()``) or a Communicator.
    :param data_parallel_size: ranks that average dense gradients (expert gradients are divided by it).
    :param comm: the job's communicator a ProcessGroup's ranks are split from (default: the one
        ``gemcore.comms.init`` made, if any; else the torch backend over ``group`` itself).
    One communicator, made here, serves every MoE layer.
    """
    moes = [i for i, b in enumerate(model.blocks) if hasattr(b.mlp, "experts") and hasattr(b.mlp, "router")]
    if not moes:
        size = group.world_size if isinstance(group, Communicator) else dist.get_world_size(group)
        raise ValueError(f"ep={size} needs a model with experts (model.moe_experts > 0)")
    ep_comm, mark = ep_communicator(group, comm)
    for i in moes:
        block = model.blocks[i]
        block.mlp = ExpertParallelMoE(block.mlp, ep_comm, data_parallel_size)
        for p in block.mlp.experts.parameters():   # the ProcessGroup, for clip_grad_norm_
            setattr(p, EP_GROUP_ATTR, mark)
    log.info("ep=%d through %s on blocks %s", ep_comm.world_size, ep_comm.describe(), moes)
    return model


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """Parameters spread over an ep group (to keep out of FSDP)."""
    return {p for p in model.parameters() if hasattr(p, EP_GROUP_ATTR)}


__all__ = ["ExpertParallelMoE", "apply_ep", "ep_communicator", "expert_parameters", "EP_GROUP_ATTR"]
