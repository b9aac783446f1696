"""Pipeline parallelism (pp > 1) for GemModel through ``torch.distributed.pipelining``.

**Split.** The model's L blocks are cut into S = pp · v stages of L/S consecutive blocks
(v = ``virtual_stages``); stage s runs on rank s mod pp of the pp group (round-robin, as
``ScheduleInterleaved1F1B`` expects). Stage 0 also owns the embeddings and the merge of history and
candidates, stage S−1 the final norm, the scoring head and the loss. Each stage is a
:class:`GemStage` whose parameters keep GemModel's names (``blocks.3.qkv.weight``), so a full state
dict is the union of the stages' (:func:`pipeline_state_dict`). Each stage is its own FSDP2 root
(every block a unit) over the data-parallel mesh, as TorchTitan does with model chunks.

**Schedule.** ``schedule="1F1B"`` runs ``Schedule1F1B`` (``ScheduleGPipe`` when a step has fewer
micro-batches than stages: 1F1B has no steady state then); ``"interleaved"`` runs
``ScheduleInterleaved1F1B`` over the rank's v stages. A step's local users are cut into micro-batches
of ``mbs`` users, in order. Gradients are not rescaled by the schedule (``scale_grads=False``): each
micro-batch's loss is its candidates' summed cross-entropy over the *step's* candidate count, so the
micro-batch losses add up to GemModel's ``loss`` on the whole local batch and the gradients equal a
single-process step's.

**Jagged micro-batches.** Pipelining sends tensors whose shapes are fixed when a stage is built,
while every micro-batch carries its own token count. What travels is one activation
``h: (R, hidden)``: the micro-batch's merged rows (T_i history + C_i candidates), then its C_i
candidate item embeddings (the head needs them; they pass the middle stages untouched, and their
gradient flows back to stage 0's table), then zero rows up to R. R is the step's largest
``T_i + 2·C_i`` rounded up to at most 8 sizes per power of two (:func:`padded_rows`: ≤ 12.5 %
extra rows). Blocks run on the real rows only (``h[:T_i + C_i]``): padding costs p2p bytes and
buffer memory, never FLOPs. The offsets, ``num_targets``, ``max_seqlen`` and candidate positions are
not sent: every rank of a pp group reads the same users (pp is not a data-parallel axis), so each
stage computes them from the batch it holds (one host sync per step for the micro-batch cuts) and
a stage's i-th forward call of a step is micro-batch i (every schedule here runs a stage's
forwards in micro-batch order; the count is checked after each step, the loss function checks its
target index against it). The stages and schedule are built for each (micro-batches, R, C)
the steps meet, with static shapes (no shape inference); the last 4 are kept, so a new padded size
costs one rebuild (Python objects, a p2p warm-up and fresh receive buffers), a repeated one nothing.

Evaluation (:meth:`PipelinedGemModel.predict`) runs the stages in order on the whole batch as one
micro-batch with blocking send/recv (no schedule), and broadcasts the logits over the pp group.

**Context parallelism** (cp > 1: ``apply_cp`` done on the whole model before the split). Every
rank of a stage's cp group holds the same micro-batches; each cuts every micro-batch's merged rows
as :class:`~gemcore.parallel.context.ContextParallelGemModel` does (``share_batch``: the
same cuts on every stage, computed from the batch) and ``h`` carries only this rank's share: its
rows, then the item embeddings of its candidates, then zeros up to R = the widest share's rows +
candidates over the cp ranks (rounded as above). The blocks get the share in place of the
offsets (K/V carries all-gathered over the cp group inside the stage); the last stage scores its
candidates and all-gathers the logits over the cp group, so the loss is the micro-batch's on every
cp rank. The cp peers of a stage run the same schedule, so their collectives (K/V and logits
gathers, FSDP2 over dp_shard x cp) pair up; the p2p of each pipeline stays within its cp rank.

Also combined: dp_shard and dp_replicate (FSDP2 / HSDP per stage), tp and ep (applied to the blocks
before the split; experts stay out of the stages' FSDP2) and activation checkpointing.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

from gemcore.data.dataset import JaggedBatch
from gemcore.model import GemModel, merge_history_and_candidates

log = logging.getLogger("gemcore.planner.pipeline")

#: compiled schedules kept per model: (micro-batches, rows, candidates) sizes met recently
SCHEDULE_CACHE = 4


def padded_rows(n: int) -> int:
    """``n`` rounded up to a multiple of 2^(⌊log2 n⌋ − 3): at most 8 sizes per power of two, at most
    12.5 % extra rows (at least 1 row: an empty shape would not be sent)."""
    if n <= 8:
        return max(n, 1)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def stage_blocks(num_blocks: int, pp: int, virtual_stages: int = 1) -> list[range]:
    """Blocks of each of the pp · virtual_stages stages (consecutive, equal counts)."""
    stages = pp * virtual_stages
    if num_blocks % stages:
        raise ValueError(f"parallelism.degrees: pp × virtual_stages = {pp} × {virtual_stages} = {stages} must "
                         f"divide the model's blocks (model.num_blocks = {num_blocks})")
    per = num_blocks // stages
    return [range(s * per, (s + 1) * per) for s in range(stages)]


def logit_dtype(dtype: torch.dtype) -> torch.dtype:
    """The last stage's logits: float32 (the loss's precision), float64 for a float64 model."""
    return torch.promote_types(dtype, torch.float32)


@dataclass
class MicroBatch:
    """One micro-batch as every stage needs it (built on every rank from the same users)."""

    batch: JaggedBatch            #: its users (stage 0 embeds them)
    rows: int                     #: merged rows: history events + candidates
    cands: int                    #: candidates C
    seq_offsets: torch.Tensor     #: (b+1,) offsets of the merged sequences
    num_targets: torch.Tensor     #: (b,) candidates per user
    cand_pos: torch.Tensor        #: (C,) rows of the merged sequences holding candidates
    cp: object = None             #: cp > 1: the ShareLayout of this micro-batch over the cp group

    @property
    def local_rows(self) -> tuple[int, int]:
        """The merged rows ``[start, end)`` this rank's blocks run on (all of them without cp)."""
        return (self.cp.share.start, self.cp.share.end) if self.cp is not None else (0, self.rows)

    @property
    def local_cands(self) -> tuple[int, int]:
        """The candidates ``[lo, hi)`` this rank scores (all of them without cp)."""
        return self.cp.cands if self.cp is not None else (0, self.cands)


def split_micro_batches(batch: JaggedBatch, mbs: int) -> list[MicroBatch]:
    """Users [k·mbs, (k+1)·mbs) of ``batch`` as micro-batch k (the last may hold fewer).
    One host sync (the batch's offsets)."""
    offsets, cand_offsets = batch.offsets.tolist(), batch.cand_offsets.tolist()
    users = len(offsets) - 1
    out = []
    for a in range(0, users, mbs):
        b = min(users, a + mbs)
        h0, h1, c0, c1 = offsets[a], offsets[b], cand_offsets[a], cand_offsets[b]
        seq = [offsets[u + 1] - offsets[u] + cand_offsets[u + 1] - cand_offsets[u] for u in range(a, b)]
        sub = JaggedBatch(item_ids=batch.item_ids[h0:h1], actions=batch.actions[h0:h1],
                          time_buckets=batch.time_buckets[h0:h1], offsets=batch.offsets[a:b + 1] - h0,
                          cand_ids=batch.cand_ids[c0:c1], cand_offsets=batch.cand_offsets[a:b + 1] - c0,
                          labels=batch.labels[c0:c1], max_len=max(seq), sum_sq_len=sum(s * s for s in seq))
        # the model's own merge on zero-width rows: the offsets and candidate rows, no copy of its logic
        _, seq_offsets, cand_pos = merge_history_and_candidates(
            sub.item_ids.new_empty(h1 - h0, 0, dtype=torch.float32), sub.offsets,
            sub.item_ids.new_empty(c1 - c0, 0, dtype=torch.float32), sub.cand_offsets)
        out.append(MicroBatch(sub, (h1 - h0) + (c1 - c0), c1 - c0, seq_offsets, sub.cand_offsets.diff(), cand_pos))
    return out


@dataclass
class StepContext:
    """What the stages of one rank share during a step (a plain object, not a module)."""

    micro: list[MicroBatch] = field(default_factory=list)
    rows: int = 1                 #: R, the padded rows of ``h``
    cands: int = 1                #: C_pad, the padded logits of the last stage
    total_cands: int = 1          #: candidates of the whole local batch (the loss's denominator)
    scale: object = None          #: GradScaler.scale, or None
    losses: list = field(default_factory=list)

    def begin(self, micro, rows, cands, scale=None):
        self.micro, self.rows, self.cands, self.scale = micro, rows, cands, scale
        self.total_cands = max(sum(m.cands for m in micro), 1)
        self.losses = []


class GemStage(nn.Module):
    """Blocks ``block_ids`` of a GemModel, with the embeddings on stage 0 and the head on the last.

    ``forward(x)``: stage 0 takes the micro-batch index (1,) int64, the others ``h: (R, hidden)``;
    returns ``h: (R, hidden)``, or on the last stage the micro-batch's logits padded to (C_pad,).
    The micro-batch is the stage's i-th call since :meth:`reset` (see the module docstring).
    """

    def __init__(self, model: GemModel, index: int, num_stages: int, block_ids: range, context: StepContext,
                 dtype: torch.dtype):
        super().__init__()
        self.index, self.num_stages, self.context, self.dtype = index, num_stages, context, dtype
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        if self.is_first:
            self.item_emb, self.action_emb, self.time_emb = model.item_emb, model.action_emb, model.time_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in block_ids})
        if self.is_last:
            self.final_norm, self.head = model.final_norm, model.head
        self.calls = 0

    def reset(self) -> None:
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.context
        if self.calls >= len(ctx.micro):
            raise RuntimeError(f"pipeline stage {self.index}: forward called {self.calls + 1} times in a step of "
                               f"{len(ctx.micro)} micro-batches")
        mb = ctx.micro[self.calls]
        self.calls += 1
        (start, end), (lo, hi) = mb.local_rows, mb.local_cands
        if self.is_first:   # x: the micro-batch index; embed and lay out [own rows, own cand items, zeros]
            merged, _, _, cand_item = GemModel.embed(self, mb.batch)
            merged, cand_item = merged[start:end], cand_item[lo:hi]
            pad = ctx.rows - merged.shape[0] - cand_item.shape[0]
            x = torch.cat([merged, cand_item.to(merged.dtype), merged.new_zeros(pad, merged.shape[1])])
        real, rest = x[:end - start], x[end - start:]
        # with cp the blocks' attention hooks take the share in place of the offsets
        offsets, targets = (mb.cp.share, None) if mb.cp is not None else (mb.seq_offsets, mb.num_targets)
        for block in self.blocks.values():
            real = block(real, offsets, targets, mb.batch.max_len)
        if not self.is_last:
            return torch.cat([real.to(self.dtype), rest.to(self.dtype)])
        logits = GemModel.score(self, real[mb.cand_pos[lo:hi] - start], rest[:hi - lo])
        if mb.cp is not None:   # every candidate's logit on every cp rank
            from gemcore.parallel.context import gather_logits

            logits = gather_logits(logits, mb.cp)
        return F.pad(logits.to(logit_dtype(self.dtype)), (0, ctx.cands - mb.cands))


class PipelinedGemModel(nn.Module):
    """This rank's stages of a pipelined GemModel. Its parameters are the rank's stages' with
    GemModel's names; train it with :meth:`forward_backward`, evaluate with :meth:`predict`."""

    def __init__(self, stages: list[GemStage], pp_group, schedule: str, mbs: int, device: torch.device,
                 hidden: int, dtype: torch.dtype, cp: dict | None = None):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for stage in stages:   # register the parts (not the stages: names stay GemModel's)
            for name, child in stage.named_children():
                if name == "blocks":
                    self.blocks.update(child)
                else:
                    self.add_module(name, child)
        self._stages = stages          # a plain list: not children
        self.pp_group, self.schedule_kind, self.mbs = pp_group, schedule, mbs
        self.device, self.hidden, self.dtype = device, hidden, dtype
        self.pp = dist.get_world_size(pp_group)
        self.pp_rank = dist.get_rank(pp_group)
        self.num_stages = stages[0].num_stages
        self.context = stages[0].context
        self.cp = cp   # cp > 1: share_batch's group and cost weights (group, attn_flops, row_flops)
        self._schedules: OrderedDict = OrderedDict()

    @property
    def stage_indices(self) -> list[int]:
        return [s.index for s in self._stages]

    def _global(self, pp_rank: int) -> int:
        return dist.get_global_rank(self.pp_group, pp_rank)

    def _schedule(self, n_micro: int, rows: int, cands: int):
        """The schedule for these sizes (built with static shapes, LRU-cached)."""
        key = (n_micro, rows, cands)
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
        )

        # static shapes (no inference pass); activations and logits carry gradients
        meta = {"device": "meta", "requires_grad": True}
        h = torch.empty(rows, self.hidden, dtype=self.dtype, **meta)
        pipe_stages = []
        for stage in self._stages:
            inputs = torch.empty(1, dtype=torch.int64, device="meta") if stage.is_first else h
            outputs = torch.empty(cands, dtype=logit_dtype(self.dtype), **meta) if stage.is_last else h
            pipe_stages.append(PipelineStage(stage, stage.index, self.num_stages, self.device, input_args=inputs,
                                             output_args=outputs, group=self.pp_group))
        kwargs = {"n_microbatches": n_micro, "loss_fn": self._loss, "scale_grads": False}
        if self.schedule_kind == "interleaved":
            schedule = ScheduleInterleaved1F1B(pipe_stages, **kwargs)
        elif n_micro >= self.num_stages:
            schedule = Schedule1F1B(pipe_stages[0], **kwargs)
        else:
            schedule = ScheduleGPipe(pipe_stages[0], **kwargs)
        log.info("pipeline stages %s: %s, %d micro-batches, h (%d, %d), logits (%d,)", self.stage_indices,
                 type(schedule).__name__, n_micro, rows, self.hidden, cands)
        self._schedules[key] = schedule
        while len(self._schedules) > SCHEDULE_CACHE:
            self._schedules.popitem(last=False)
        return schedule

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Micro-batch ``target`` (its index): summed BCE of its candidates over the step's candidates."""
        ctx, index = self.context, int(target.reshape(-1)[0])
        last = self._stages[-1]
        if index != last.calls - 1:
            raise RuntimeError(f"pipeline: loss of micro-batch {index} after forward {last.calls - 1}")
        mb = ctx.micro[index]
        loss = F.binary_cross_entropy_with_logits(logits[:mb.cands], mb.batch.labels, reduction="sum")
        loss = loss / ctx.total_cands
        ctx.losses.append(loss.detach())
        return ctx.scale(loss) if ctx.scale is not None else loss

    def _begin(self, batch: JaggedBatch, mbs: int, scale=None) -> list[MicroBatch]:
        if batch.batch_size < 1:
            raise ValueError("pipeline: a step needs at least one user")
        micro = split_micro_batches(batch, mbs)
        if self.cp is not None:   # each micro-batch's rows cut over the cp group, as ContextParallelGemModel does
            from gemcore.parallel.context import share_batch

            for m in micro:
                m.cp = share_batch(m.seq_offsets, m.num_targets, m.cand_pos, max_seqlen=m.batch.max_len, **self.cp)
        # every cp rank of a stage passes the same shape: the widest share's
        rows = padded_rows(max(m.cp.widest() if m.cp is not None else m.rows + m.cands for m in micro))
        cands = padded_rows(max(m.cands for m in micro))
        self.context.begin(micro, rows, cands, scale)
        for stage in self._stages:
            stage.reset()
        return micro

    def _check_calls(self, n_micro: int) -> None:
        for stage in self._stages:
            if stage.calls != n_micro:
                raise RuntimeError(f"pipeline stage {stage.index}: {stage.calls} forward calls for {n_micro} "
                                   "micro-batches")

    def forward_backward(self, batch: JaggedBatch, scale=None) -> torch.Tensor:
        """One training step's forward and backward through the schedule; gradients accumulate in
        the parameters (zero them before). ``scale``: applied to each micro-batch loss before its
        backward (``GradScaler.scale``). Returns the unscaled loss, the same on every pp rank."""
        micro = self._begin(batch, self.mbs, scale)
        schedule = self._schedule(len(micro), self.context.rows, self.context.cands)
        index = torch.arange(len(micro))
        args = (index,) if any(s.is_first for s in self._stages) else ()
        target = index if any(s.is_last for s in self._stages) else None
        schedule.step(*args, target=target)
        self._check_calls(len(micro))
        if target is not None:
            loss = torch.stack(self.context.losses).sum().float().to(self.device)
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self._global(self.pp - 1), group=self.pp_group)
        return loss

    @torch.no_grad()
    def predict(self, batch: JaggedBatch) -> torch.Tensor:
        """GemModel's forward for evaluation: logits (C,) on every pp rank. The whole batch is one
        micro-batch; stages run in order with blocking send/recv."""
        self._begin(batch, max(batch.batch_size, 1))
        ctx, mine = self.context, {s.index: s for s in self._stages}
        h = None
        for s in range(self.num_stages):
            if s not in mine:
                continue
            if s == 0:
                x = torch.zeros(1, dtype=torch.int64, device=self.device)
            else:
                x = torch.empty(ctx.rows, self.hidden, dtype=self.dtype, device=self.device)
                dist.recv(x, src=self._global((s - 1) % self.pp), group=self.pp_group)
            h = mine[s](x)
            if s < self.num_stages - 1:
                dist.send(h.contiguous(), dst=self._global((s + 1) % self.pp), group=self.pp_group)
        self._check_calls(1)
        logits = h if self.num_stages - 1 in mine else torch.empty(ctx.cands, dtype=logit_dtype(self.dtype),
                                                                   device=self.device)
        dist.broadcast(logits, src=self._global(self.pp - 1), group=self.pp_group)
        return logits[:ctx.micro[0].cands]

    def forward(self, batch: JaggedBatch) -> torch.Tensor:
        if torch.is_grad_enabled() and self.training:
            raise RuntimeError("a pipelined model trains through forward_backward(batch), not forward")
        return self.predict(batch)


def apply_pipeline(model: GemModel, *, pp_mesh, fsdp_mesh=None, schedule: str = "1F1B", virtual_stages: int = 1,
                   mbs: int = 1, device: torch.device, reshard_after_forward: bool = True,
                   ignored_params: set | None = None) -> PipelinedGemModel:
    """Split ``model`` (activation checkpointing already applied) into pp · virtual_stages stages,
    keep this rank's, shard each over ``fsdp_mesh`` (FSDP2, per block then the stage) when given;
    ``ignored_params`` (expert-parallel experts) stay out of FSDP. A ``ContextParallelGemModel``
    (``apply_cp`` done on the whole model) gives context-parallel stages: each micro-batch's rows are
    cut over its cp group and each stage runs and passes on this rank's share only."""
    pp = pp_mesh.size()
    blocks = stage_blocks(len(model.blocks), pp, virtual_stages)
    pp_rank = pp_mesh.get_local_rank()
    dtype = model.item_emb.weight.dtype
    context = StepContext()
    stages = [GemStage(model, s, len(blocks), blocks[s], context, dtype)
              for s in range(len(blocks)) if s % pp == pp_rank]
    for stage in stages:
        stage.to(device)
    if fsdp_mesh is not None:
        from torch.distributed.fsdp import fully_shard

        for stage in stages:
            kept = {p for p in stage.parameters() if p in (ignored_params or ())} or None
            for block in stage.blocks.values():
                fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept)
            fully_shard(stage, mesh=fsdp_mesh, reshard_after_forward=reshard_after_forward, ignored_params=kept)
    from gemcore.parallel.context import ContextParallelGemModel

    cp = None
    if isinstance(model, ContextParallelGemModel):
        cp = {"group": model.cp_group, "attn_flops": model.cp_attn_flops, "row_flops": model.cp_row_flops}
    out = PipelinedGemModel(stages, pp_mesh.get_group(), schedule, mbs, device, model.cfg.hidden, dtype, cp)
    log.info("pp=%d (%s, v=%d): rank %d holds stages %s, blocks %s%s", pp, schedule, virtual_stages, pp_rank,
             out.stage_indices, [list(stage.blocks) for stage in stages],
             f", FSDP over {fsdp_mesh.mesh_dim_names}" if fsdp_mesh is not None else "")
    return out


def is_pipelined(model) -> bool:
    return isinstance(model, PipelinedGemModel)


def pipeline_state_dict(model: PipelinedGemModel, optimizer) -> tuple[dict, dict]:
    """Full model and optimizer state of the whole pipeline (keys as GemModel's) on pp rank 0,
    ``({}, {})`` elsewhere. A collective: every rank calls it."""
    from torch.distributed.checkpoint import state_dict as dcp

    # not cpu_offload: that keeps the state on global rank 0 only, and the other stages' ranks
    # must send theirs; each stage's full state is moved to the host here instead
    options = dcp.StateDictOptions(full_state_dict=True)
    state = dcp.get_state_dict(model, optimizer, options=options)
    model_state, optim_state = tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v, state)
    parts = [None] * model.pp if model.pp_rank == 0 else None
    dist.gather_object((model_state, optim_state), parts, dst=model._global(0), group=model.pp_group)
    if model.pp_rank != 0:
        return {}, {}
    merged_model, merged_optim = {}, {"state": {}, "param_groups": []}
    for part_model, part_optim in parts:
        merged_model.update(part_model)
        merged_optim["state"].update(part_optim["state"])
        for i, group in enumerate(part_optim["param_groups"]):
            if i == len(merged_optim["param_groups"]):
                merged_optim["param_groups"].append({**group, "params": []})
            merged_optim["param_groups"][i]["params"] += list(group["params"])
    return merged_model, merged_optim


__all__ = ["apply_pipeline", "PipelinedGemModel", "GemStage", "split_micro_batches", "padded_rows",
           "stage_blocks", "is_pipelined", "pipeline_state_dict"]
