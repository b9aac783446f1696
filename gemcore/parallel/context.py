"""Context parallelism for GemModel's jagged batches: the users of a batch stay on every rank of
the cp group, but each rank runs the blocks on a contiguous, cost-balanced share of the merged
token rows (history + candidates of all users, in the model's order).

Split. Row ``i`` of a sequence with ``h`` history tokens costs ``attn_flops·keys(i) + row_flops``
(``keys(i) = i + 1`` for history, ``h + 1`` for a candidate, which sees the history and itself);
the global prefix sum of those costs is cut into ``cp`` equal parts, so attention and token-wise
work are balanced together. A cut may fall inside a sequence (a long history spans several ranks).

Per block, rank ``r`` with rows ``[start, end)`` runs norms, projections and the MLP on its rows
only. Attention is exact:

* the sequences that *start* inside the share (whole, or a causal prefix cut at ``end``) need no
  keys from elsewhere: a prefix of a causal sequence only looks backwards, and a candidate sees
  only history before it and itself. They go through the model's own attention hook unchanged
  (the fused kernel on GPU), with ``num_targets`` reduced to the candidates present;
* the *continuation* — the share's first rows when they continue a sequence that began on an
  earlier rank — needs that sequence's earlier keys. Every rank sends its *carry* (the rows of
  its last sequence when that sequence continues past its share) with one all-gather of K|V per
  block (an autograd all-gather whose backward reduce-scatters the key gradients back to their
  owners). The continuation's queries then attend to ``[carries of the
  earlier ranks, own keys]`` with the hook's mask at query positions offset by the keys before
  them (:func:`offset_attention`, plain PyTorch). At most one continuation per rank and block.

The logits of each rank's candidates are all-gathered (with autograd) into the batch's ``(C,)``
order, so ``loss`` is the ordinary mean over all candidates on every rank of the group. Each rank
then back-propagates the same loss, so parameter gradients summed over the group are ``cp`` times
the gradient; FSDP's mean over ``dp_shard x cp`` (the cp ranks join the FSDP mesh) divides that
``cp`` out again.

Cost and memory, per block (``T`` rows of the batch, ``c = cp``, kv width ``w = H·(Dqk + Dv)``):
activations of norms, projections, MLP and attention output drop to ``T/c`` rows. Communication:
the carries, ``c · max carry · w`` elements gathered (≤ one sequence per rank for many short
users, up to ``T·w`` — the whole K/V — for a single long history), the same again (their
gradients) in the backward, plus ``C`` logits. The continuation's attention materialises its
(rows × keys × H) scores in plain PyTorch: fine for recsys histories of a few thousand tokens; a
fused kernel needs a hook that accepts a query position offset (not in the hook contract yet).
The batch's embedding rows are looked up on every rank (``T × hidden`` once per step).
"""
from __future__ import annotations

import bisect
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gemcore.kernels.jagged_attention_reference import ACTIVATIONS
from gemcore.model import GemModel


class JaggedShare:
    """One cp rank's share of a batch's merged rows; handed to the blocks in place of ``offsets``.

    ``start``/``end``: global rows ``[start, end)``. ``own_offsets`` (n+1,) and ``own_targets``
    (n,): the sequences starting in the share, in local rows (the first at ``cont_rows``).
    ``cont_rows``: local rows ``[0, cont_rows)`` continue a sequence with ``cont_before`` rows on
    earlier ranks and ``cont_history`` history tokens. ``carries``: every rank's carry length;
    ``cont_from``: the ranks whose carries precede the continuation, in order.
    """

    __slots__ = ("start", "end", "own_offsets", "own_targets", "cont_rows", "cont_before", "cont_history",
                 "carries", "cont_from", "group", "max_seqlen")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields[name])


def split_rows(seq_offsets: torch.Tensor, num_targets: torch.Tensor, cp: int, *, attn_flops: float,
               row_flops: float) -> list[int]:
    """Cut points ``[0, c_1, ..., T]`` (cp + 1 ints) balancing the causal attention + token-wise cost."""
    T = int(seq_offsets[-1])
    B = seq_offsets.numel() - 1
    lengths = seq_offsets.diff()
    seq = torch.repeat_interleave(torch.arange(B, device=seq_offsets.device), lengths, output_size=T)
    pos = torch.arange(T, device=seq_offsets.device) - seq_offsets[seq]
    history = (lengths - num_targets)[seq]
    keys = torch.where(pos < history, pos + 1, history + 1).double()
    cost = torch.cumsum(keys * attn_flops + row_flops, 0)
    if T == 0:
        return [0] * (cp + 1)
    targets = cost[-1] * torch.arange(1, cp, device=cost.device, dtype=cost.dtype) / cp
    cuts = torch.searchsorted(cost, targets, right=True).tolist()
    return [0, *cuts, T]


def make_share(seq_offsets: torch.Tensor, num_targets: torch.Tensor, cuts: list[int], rank: int, group,
               max_seqlen) -> JaggedShare:
    """This rank's :class:`JaggedShare` (host bookkeeping on ``B + 1`` offsets, one sync)."""
    offs = seq_offsets.tolist()
    targets = num_targets.tolist()
    starts = set(offs[:-1])
    cp = len(cuts) - 1

    def seq_of(row: int) -> int:  # the last sequence starting at or before global row ``row``
        return bisect.bisect_right(offs, row) - 1

    carries = []
    for q in range(cp):
        s, e = cuts[q], cuts[q + 1]
        if e <= s or e >= offs[-1] or e in starts:
            carries.append(0)
        else:
            carries.append(e - max(s, offs[seq_of(e - 1)]))
    start, end = cuts[rank], cuts[rank + 1]
    cont_rows = cont_before = cont_history = 0
    cont_from = []
    if end > start and start not in starts:
        b = seq_of(start)
        cont_before = start - offs[b]
        cont_rows = min(end, offs[b + 1]) - start
        cont_history = offs[b + 1] - offs[b] - targets[b]
        cont_from = [q for q in range(rank) if carries[q] and cuts[q + 1] > offs[b]]
    own_offsets, own_targets = [cont_rows], []
    first, last = bisect.bisect_left(offs, start), min(bisect.bisect_left(offs, end), len(offs) - 1)
    for b in range(first, last):  # the non-empty sequences starting in the share
        if offs[b + 1] > offs[b]:
            rows = min(end, offs[b + 1]) - offs[b]
            history = offs[b + 1] - offs[b] - targets[b]
            own_offsets.append(own_offsets[-1] + rows)
            own_targets.append(max(0, rows - history))
    device = seq_offsets.device
    return JaggedShare(start=start, end=end,
                       own_offsets=torch.tensor(own_offsets, dtype=seq_offsets.dtype, device=device),
                       own_targets=torch.tensor(own_targets, dtype=num_targets.dtype, device=device),
                       cont_rows=cont_rows, cont_before=cont_before, cont_history=cont_history,
                       carries=carries, cont_from=cont_from, group=group, max_seqlen=max_seqlen)


class _AllGather(torch.autograd.Function):
    """All-gather with autograd: forward stacks every rank's ``x`` (cp, *x.shape); backward sums
    the gradients over the group and keeps this rank's (reduce-scatter on NCCL; gloo has none,
    so an all-reduce there). torch.distributed.nn.functional.all_gather's gloo backward fails
    on a sub-group that leaves out global rank 0 or 1 (its all-to-all scatters from global ranks)."""

    @staticmethod
    def forward(ctx, x, group):
        # a functional collective (a new tensor, not an in-place c10d call), so selective
        # activation checkpointing keeps its output (apply.SELECTIVE_AC_SAVE) instead of
        # gathering again in the backward
        from torch.distributed import _functional_collectives as funcol

        ctx.group = group
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor  # torch < 2.13
        gathered = funcol.wait_tensor(gather(x.contiguous(), 0, group))
        return gathered.view(dist.get_world_size(group), *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == dist.Backend.NCCL:
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out, grad, group=ctx.group)
            return out, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)].clone(), None


def gather_rows(x: torch.Tensor, counts: list[int], group) -> torch.Tensor:
    """Concatenate every rank's ``x`` (``counts[r]`` rows each) in rank order, with autograd
    (padded to the longest: gloo and NCCL all-gather equal shapes)."""
    rows = max(max(counts), 1)
    padded = F.pad(x, (0, 0) * (x.dim() - 1) + (0, rows - x.shape[0]))
    parts = _AllGather.apply(padded, group)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])


def offset_attention(q, k, v, *, q_start: int, history: int, activation: str, scale, norm) -> torch.Tensor:
    """Attention of queries at positions ``q_start + i`` of one sequence to its keys ``[0, len(k))``,
    with the hook's causal + candidates mask (``j <= p`` and ``j < history or j == p``).
    q: (n, H, Dqk), k: (Lk, H, Dqk), v: (Lk, H, Dv) -> (n, H, Dv). Computed in float32 like the
    reference."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    p = torch.arange(q.shape[0], device=q.device)[:, None] + q_start
    j = torch.arange(k.shape[0], device=q.device)[None, :]
    allowed = (j <= p) & ((j < history) | (j == p))
    scores = torch.einsum("ihd,jhd->hij", q.to(compute), k.to(compute)) * scale
    if activation == "softmax":
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # every row allows its own key: no empty rows
    else:
        probs = ACTIVATIONS[activation](scores) * allowed / norm
    return torch.einsum("hij,jhd->ihd", probs, v.to(compute)).to(q.dtype)


class ContextParallelAttention:
    """Replaces a block's attention hook; called by the block with a :class:`JaggedShare` as
    ``offsets``. ``inner`` (the model's hook) runs the sequences that start in the share."""

    def __init__(self, inner, *, activation: str = "softmax", scale=None, norm=None):
        if activation != "softmax" and activation not in ACTIVATIONS:
            raise ValueError(f"activation must be 'softmax' or one of {sorted(ACTIVATIONS)}, "
                             f"got {activation!r}")
        self.inner, self.activation, self.scale, self.norm = inner, activation, scale, norm

    def __call__(self, q, k, v, share: JaggedShare, *, causal=True, num_targets=None, max_seqlen=None):
        if not isinstance(share, JaggedShare) or not causal:
            raise ValueError("context-parallel attention expects the JaggedShare of "
                             "ContextParallelGemModel.forward as offsets, with causal=True")
        if not max(share.carries):
            before = k.new_zeros(0, k.shape[1], k.shape[2] + v.shape[2])
            return attend_share(q, k, v, share, before, self.inner, activation=self.activation,
                                scale=self.scale, norm=self.norm, max_seqlen=max_seqlen)
        carry = share.carries[dist.get_rank(share.group)]
        gathered = gather_rows(torch.cat([k, v], dim=-1)[k.shape[0] - carry:], share.carries, share.group)
        bounds = [0]
        for c in share.carries:
            bounds.append(bounds[-1] + c)
        before = torch.cat([gathered[:0]] + [gathered[bounds[r]:bounds[r + 1]] for r in share.cont_from])
        out = attend_share(q, k, v, share, before, self.inner, activation=self.activation, scale=self.scale,
                           norm=self.norm, max_seqlen=max_seqlen)
        return out + 0.0 * gathered.sum()  # every rank's backward must run the gather's collective


def attend_share(q, k, v, share: JaggedShare, before: torch.Tensor, inner, *, activation: str, scale, norm,
                 max_seqlen) -> torch.Tensor:
    """Attention of a share's rows. q, k, v: (rows, H, D) of the share; ``before``:
    (share.cont_before, H, Dqk + Dv), the K|V rows of the continued sequence on earlier ranks.
    The continuation goes through :func:`offset_attention`, the share's own sequences through
    ``inner`` (the model's attention hook)."""
    n, dk = share.cont_rows, k.shape[-1]
    if before.shape[0] != share.cont_before:
        raise AssertionError(f"continuation has {before.shape[0]} earlier keys, expected {share.cont_before}")
    parts = []
    if n:
        keys = torch.cat([before, torch.cat([k[:n], v[:n]], dim=-1)])
        norm = norm if norm is not None else max(max_seqlen or 1, 1)
        parts.append(offset_attention(q[:n], keys[..., :dk], keys[..., dk:], q_start=share.cont_before,
                                      history=share.cont_history, activation=activation, scale=scale,
                                      norm=norm))
    if share.own_offsets.numel() > 1:
        parts.append(inner(q[n:], k[n:], v[n:], share.own_offsets - n, causal=True,
                           num_targets=share.own_targets, max_seqlen=share.max_seqlen))
    if not parts:
        return q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    out = torch.cat(parts) if len(parts) > 1 else parts[0]
    if out.shape[0] != q.shape[0]:
        raise AssertionError(f"context-parallel attention covered {out.shape[0]} of {q.shape[0]} rows")
    return out


class ContextParallelGemModel(GemModel):
    """GemModel whose blocks run on this cp rank's share (``apply_cp`` swaps the class of a built
    model, so parameter names and the state dict stay GemModel's). forward(batch) -> (C,) logits
    of all the batch's candidates (gathered over the cp group)."""

    cp_group = None
    cp_attn_flops = 1.0
    cp_row_flops = 1.0

    def forward(self, batch) -> torch.Tensor:
        x, seq_offsets, cand_pos, cand_item = self.embed(batch)
        layout = share_batch(seq_offsets, batch.cand_offsets.diff(), cand_pos, self.cp_group,
                             attn_flops=self.cp_attn_flops, row_flops=self.cp_row_flops, max_seqlen=batch.max_len)
        share, (lo, hi) = layout.share, layout.cands
        x = x[share.start:share.end]
        for block in self.blocks:
            x = block(x, share, None, batch.max_len)
        local = self.score(x[cand_pos[lo:hi] - share.start], cand_item[lo:hi])
        return gather_logits(local, layout)


class ShareLayout:
    """Every cp rank's share of one batch, as :func:`share_batch` cuts it: ``share`` (this rank's
    :class:`JaggedShare`), ``cuts`` (cp + 1,) row bounds and ``cand_bounds`` (cp + 1,) candidate
    bounds of the ranks' shares (candidates in the batch's ``(C,)`` order)."""

    __slots__ = ("share", "cuts", "cand_bounds")

    def __init__(self, share: JaggedShare, cuts: list[int], cand_bounds: list[int]):
        self.share, self.cuts, self.cand_bounds = share, cuts, cand_bounds

    @property
    def cands(self) -> tuple[int, int]:
        """This rank's candidates ``[lo, hi)``."""
        rank = dist.get_rank(self.share.group)
        return self.cand_bounds[rank], self.cand_bounds[rank + 1]

    def widest(self) -> int:
        """The largest rows + candidates of any rank's share (what a pipeline stage passes on)."""
        return max(self.cuts[r + 1] - self.cuts[r] + self.cand_bounds[r + 1] - self.cand_bounds[r]
                   for r in range(len(self.cuts) - 1))


def share_batch(seq_offsets: torch.Tensor, num_targets: torch.Tensor, cand_pos: torch.Tensor, group, *,
                attn_flops: float, row_flops: float, max_seqlen) -> ShareLayout:
    """Cut a merged batch (``seq_offsets`` (B+1,), ``num_targets`` (B,), ``cand_pos`` (C,) rows of
    the candidates) over the cp ``group``: :func:`split_rows`, this rank's :func:`make_share` and
    the candidates of each share."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cuts = split_rows(seq_offsets, num_targets, cp, attn_flops=attn_flops, row_flops=row_flops)
    share = make_share(seq_offsets, num_targets, cuts, rank, group, max_seqlen)
    bounds = torch.searchsorted(cand_pos, torch.tensor(cuts, device=cand_pos.device)).tolist()
    return ShareLayout(share, cuts, bounds)


def gather_logits(local: torch.Tensor, layout: ShareLayout) -> torch.Tensor:
    """This rank's candidates' logits (hi - lo,) -> every candidate's (C,), with autograd."""
    b = layout.cand_bounds
    counts = [b[r + 1] - b[r] for r in range(len(b) - 1)]
    return gather_rows(local[:, None], counts, layout.share.group).squeeze(-1)


def apply_cp(model: nn.Module, cp_group, *, activation: str = "softmax", scale=None, norm=None) -> nn.Module:
    """Context parallelism over ``cp_group`` (see the module docstring): swaps ``model``'s class
    to :class:`ContextParallelGemModel` and each block's attention hook to
    :class:`ContextParallelAttention`. ``activation``/``scale``/``norm``: the attention config
    the model's hook was built with (the continuation rows reproduce it)."""
    if type(model) is not GemModel:
        raise ValueError(f"model: context parallelism applies to a GemModel, got {type(model).__name__}")
    block = model.blocks[0]
    model.cp_group = cp_group
    model.cp_attn_flops = 4.0 * block.num_heads * block.head_dim          # QKᵀ and PV per key, forward
    model.cp_row_flops = 2.0 * sum(p.numel() for p in block.parameters())  # token-wise matmuls
    for block in model.blocks:
        block.attention = ContextParallelAttention(block.attention, activation=activation, scale=scale,
                                                   norm=norm)
    model.__class__ = ContextParallelGemModel
    return model


__all__ = ["JaggedShare", "ShareLayout", "split_rows", "make_share", "share_batch", "gather_rows", "gather_logits",
           "offset_attention", "attend_share", "ContextParallelAttention", "ContextParallelGemModel", "apply_cp"]
