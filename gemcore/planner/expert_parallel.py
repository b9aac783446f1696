"""Expert parallelism for GemModel's mixture of experts: each rank of the ep group holds
``num_experts / ep`` experts; tokens travel to their experts and back with two all-to-alls.

:class:`ExpertParallelMoE` replaces a block's :class:`gemcore.model.MoEMLP` (``apply_ep`` swaps the
module; model.py stays free of parallelism code). Forward, per MoE layer, on ``T`` local tokens:

1. route as MoEMLP does (softmax, top-k, renormalised weights), sort the ``T·k`` assignments by
   expert (experts of rank ``r`` are ``[r·E/ep, (r+1)·E/ep)``, so the sort also groups by rank);
2. exchange the per-expert counts (one small all-to-all), then the token rows themselves
   (``torch.distributed.nn.functional.all_to_all_single``, which carries gradients back);
3. regroup the received rows by local expert, run each expert, undo the regrouping;
4. send the outputs back (the reverse all-to-all), weight them and add them to their tokens.

Gradients: an expert's gradient on its owner sums the contributions of every ep rank's tokens,
while FSDP averages dense gradients over the ``dp`` data-parallel ranks; a hook divides expert
gradients by ``dp`` so both are gradients of the same global mean loss. Expert parameters are
left out of FSDP (``ignored_params``) and marked with ``EP_GROUP_ATTR`` so gradient clipping sums
their norms over the ep group.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_to_all_single

#: attribute set on expert parameters: the process group their experts are spread over
EP_GROUP_ATTR = "_gemcore_ep_group"


class ExpertParallelMoE(nn.Module):
    """The experts of ``moe`` (a MoEMLP: ``router``, ``experts``, ``top_k``) spread over ``group``.

    x: (T, hidden) -> (T, hidden), the same function as ``moe`` on the same tokens.
    """

    def __init__(self, moe: nn.Module, group, data_parallel_size: int):
        super().__init__()
        self.group = group
        self.ep = dist.get_world_size(group)
        self.ep_rank = dist.get_rank(group)
        self.num_experts = len(moe.experts)
        if self.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} must divide the experts ({self.num_experts})")
        self.local_experts = self.num_experts // self.ep
        self.top_k = moe.top_k
        self.router = moe.router
        first = self.ep_rank * self.local_experts
        self.experts = nn.ModuleList(moe.experts[first:first + self.local_experts])
        scale = 1.0 / data_parallel_size
        for p in self.experts.parameters():
            setattr(p, EP_GROUP_ATTR, group)
            p.register_hook(lambda g, s=scale: g * s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        E, k, ep, local = self.num_experts, self.top_k, self.ep, self.local_experts
        weights, expert = self.router(x).softmax(dim=-1).topk(k, dim=-1)        # (T, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_expert = expert.reshape(-1)
        order = flat_expert.argsort(stable=True)                                 # by expert = by rank
        rows = order // k
        counts = torch.bincount(flat_expert, minlength=E)                        # (E,) sent per expert
        recv_counts = torch.empty_like(counts)                                   # (ep * local,) [src][e]
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send_splits = counts.view(ep, local).sum(1).tolist()
        blocks = recv_counts.view(ep, local)
        recv_splits = blocks.sum(1).tolist()

        received = all_to_all_single(x.new_empty(sum(recv_splits), x.shape[1]), x[rows],
                                     recv_splits, send_splits, group=self.group)
        # received rows are grouped [source][local expert]; regroup them [local expert][source]
        pieces = torch.arange(received.shape[0], device=x.device).split(blocks.reshape(-1).tolist())
        regroup = torch.cat([pieces[s * local + e] for e in range(local) for s in range(ep)]
                            ) if pieces else received.new_empty(0, dtype=torch.long)
        grouped = received[regroup]
        outputs = []
        for e, chunk in zip(self.experts, grouped.split(blocks.sum(0).tolist())):
            outputs.append(e(chunk) if chunk.numel() else chunk)
        done = torch.cat(outputs)[regroup.argsort()] if outputs else grouped
        back = all_to_all_single(x.new_empty(rows.shape[0], x.shape[1]), done,
                                 send_splits, recv_splits, group=self.group)
        y = back * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, rows, y.to(x.dtype))


def apply_ep(model: nn.Module, group, data_parallel_size: int) -> nn.Module:
    """Replace every block's MoE (a module with ``router`` and ``experts``) by an
    :class:`ExpertParallelMoE` over ``group``; raises if the model has no experts."""
    swapped = []
    for i, block in enumerate(model.blocks):
        if hasattr(block.mlp, "experts") and hasattr(block.mlp, "router"):
            block.mlp = ExpertParallelMoE(block.mlp, group, data_parallel_size)
            swapped.append(i)
    if not swapped:
        raise ValueError(f"ep={dist.get_world_size(group)} needs a model with experts (model.moe_experts > 0)")
    return model


def expert_parameters(model: nn.Module) -> set[nn.Parameter]:
    """Parameters spread over an ep group (to keep out of FSDP)."""
    return {p for p in model.parameters() if hasattr(p, EP_GROUP_ATTR)}


__all__ = ["ExpertParallelMoE", "apply_ep", "expert_parameters", "EP_GROUP_ATTR"]
