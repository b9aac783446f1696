"""Enumerate plans for a model on a cluster, drop the infeasible ones, rank the rest.

Candidates: every factorisation of the GPU count into pp x dp_replicate x dp_shard x cp x tp with
tp dividing the heads (and kv heads), ep dividing both the experts and dp_shard x cp, cp only
where sequences are long enough to split (>= 1024 tokens per rank), pp no larger than the layers;
for each, micro-batches of 1, 2, 4, 8 sequences (GEM: users, up to the per-rank batch),
activation checkpointing none / selective / full, FSDP resharding on or off, and for pp > 1 the
1F1B schedule or interleaving with 2 or 4 virtual stages. A plan survives if it breaks no rule of
:meth:`Plan.violations` and its memory fits; survivors are ranked by tokens/s per GPU (ties: less
memory). Plans whose tp or ep group leaves the node are kept but rank where their cost puts them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Iterable

from gemcore.planner.cluster import KERNEL_STACKS, Cluster
from gemcore.planner.cost import MEMORY_HEADROOM, Estimate, estimate, training_state_bytes
from gemcore.planner.models import ModelSpec
from gemcore.planner.plan import Plan


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass
class SearchResult:
    plans: list[Estimate]          #: feasible, best first
    considered: int                #: layouts evaluated
    rejected: dict[str, int]       #: why the others were dropped (first reason), counted
    smallest_memory: Estimate | None  #: the least memory-hungry layout (to explain a model that cannot fit)


def candidate_degrees(model: ModelSpec, cluster: Cluster, seq_len: int):
    """Yield (pp, dp_replicate, dp_shard, cp, tp, ep) whose product is the GPU count."""
    n = cluster.gpus
    mean_len, _ = model.length_moments(seq_len)
    for tp in divisors(n):
        if model.num_heads % tp or model.num_kv_heads % tp:
            continue
        for cp in divisors(n // tp):
            if cp > 1 and mean_len / cp < 1024:
                continue
            for pp in divisors(n // (tp * cp)):
                if pp > model.num_layers:
                    continue
                rest = n // (tp * cp * pp)
                for dp_shard in divisors(rest):
                    dp_replicate = rest // dp_shard
                    eps = [1]
                    if model.is_moe:
                        eps = [e for e in divisors(model.num_experts) if (dp_shard * cp) % e == 0]
                    for ep in eps:
                        yield pp, dp_replicate, dp_shard, cp, tp, ep


def search(model: ModelSpec, cluster: Cluster, *, seq_len: int | None = None,
           global_batch: int | None = None, top: int = 5,
           allow: Callable[[Plan], bool] | None = None) -> SearchResult:
    """The ``top`` feasible plans, best first; ``allow`` (degrees only) restricts the layouts,
    e.g. to those :func:`gemcore.parallel.apply.check_supported` accepts."""
    S = seq_len or model.seq_len
    B = global_batch or model.default_global_batch(cluster.gpus, S)
    feasible: list[Estimate] = []
    rejected: dict[str, int] = {}
    smallest: Estimate | None = None
    considered = 0
    mbs_choices = [1, 2, 4, 8] if model.kind == "llm" else [1, 8, 32, 128, 512]
    for pp, dpr, dps, cp, tp, ep in candidate_degrees(model, cluster, S):
        if B % (dpr * dps):
            _count(rejected, "batch split")
            continue
        if allow is not None and not allow(Plan(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep)):
            _count(rejected, "not allowed")
            continue
        # the least memory this layout can take: one sequence per micro-batch, full recompute
        probe = Plan(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, ac="full",
                     reshard_after_forward=True)
        if not probe.broken_rules(model, B, cluster.gpus):
            est = estimate(model, cluster, probe, seq_len=S, global_batch=B)
            if smallest is None or est.memory_total < smallest.memory_total:
                smallest = est
            if not est.fits:
                _count(rejected, "memory")
                continue
        elif training_state_bytes(model, probe) > MEMORY_HEADROOM * cluster.hbm_bytes:
            _count(rejected, "memory")
            continue
        schedules = [("1F1B", 1)]
        if pp > 1:
            schedules += [("interleaved", v) for v in (2, 4) if pp * v <= model.num_layers]
        reshards = (True,) if dps * cp == 1 else (True, False)   # without FSDP the flag means nothing
        for mbs in mbs_choices:
            if (B // (dpr * dps)) % mbs:
                continue
            any_fit = False
            for schedule, v in schedules:
                for reshard in reshards:
                    base = Plan(dp_replicate=dpr, dp_shard=dps, cp=cp, tp=tp, pp=pp, ep=ep, mbs=mbs,
                                schedule=schedule, virtual_stages=v, reshard_after_forward=reshard)
                    problems = base.broken_rules(model, B, cluster.gpus)
                    considered += 1
                    if problems:
                        _count(rejected, problems[0][0])
                        continue
                    # full recompute needs the least memory: if it does not fit, nothing does;
                    # of the recompute modes that fit, keep the fastest
                    fits = []
                    for ac in ("full", "none", "selective"):
                        est = estimate(model, cluster, replace(base, ac=ac), seq_len=S, global_batch=B)
                        considered += ac != "full"
                        if smallest is None or est.memory_total < smallest.memory_total:
                            smallest = est
                        if est.fits:
                            fits.append(est)
                        else:
                            _count(rejected, "memory")
                            if ac == "full":
                                break
                    if fits:
                        feasible.append(max(fits, key=lambda e: e.tokens_per_s_per_gpu))
                        any_fit = True
            if not any_fit:
                break  # a larger micro-batch needs more memory still
    feasible.sort(key=_rank_key)
    return SearchResult(feasible[:top], considered, rejected, smallest)


#: knobs of one layout that :func:`complete` searches when the user does not give them
SEARCHED_KNOBS = ("mbs", "ac", "sac", "schedule", "virtual_stages", "reshard_after_forward", "kernels")


def complete(model: ModelSpec, cluster: Cluster, plan: Plan, given: Iterable[str], *,
             seq_len: int | None = None, global_batch: int | None = None,
             kernels_given: bool = True) -> "Completion":
    """The fastest fitting layout with ``plan``'s degrees, searching each knob of
    :data:`SEARCHED_KNOBS` not named in ``given`` (``Plan`` field names): micro-batch, activation
    checkpointing and its selective policy, schedule and virtual stages, FSDP resharding and, when
    ``kernels_given`` is false, the cluster's kernel stack. Knobs in ``given`` keep ``plan``'s values.

    Rules the degrees break (:meth:`Plan.violations`) are the caller's to check first.
    """
    given = set(given)
    S = seq_len or model.seq_len
    B = global_batch or model.default_global_batch(cluster.gpus, S)
    per_rank = B // plan.dp if B % plan.dp == 0 else 0

    def options(name: str, values: list) -> list:
        return [getattr(plan, name)] if name in given else values

    mbs_all = [1, 2, 4, 8] if model.kind == "llm" else [1, 8, 32, 128, 512]
    mbs_choices = options("mbs", [m for m in mbs_all if per_rank and per_rank % m == 0] or [plan.mbs])
    ac_choices = options("ac", ["none", "selective", "full"])
    if "virtual_stages" in given:
        sched_choices = [(plan.schedule, plan.virtual_stages)]
    elif "schedule" in given and plan.schedule == "1F1B" or plan.pp == 1:
        sched_choices = [("1F1B", 1)]
    else:
        vs = [v for v in (2, 4, 8) if plan.pp * v <= model.num_layers]
        sched_choices = ([] if "schedule" in given else [("1F1B", 1)]) + [("interleaved", v) for v in vs]
        sched_choices = sched_choices or [(plan.schedule, plan.virtual_stages)]
    reshard_choices = options("reshard_after_forward",
                              [True] if plan.dp_shard * plan.cp == 1 else [True, False])
    clusters = ([cluster] if kernels_given else
                [replace(cluster, kernels=k) for k in KERNEL_STACKS])
    out = Completion(None, None, 0, cluster.kernels)
    for cl in clusters:
        for mbs in mbs_choices:
            for schedule, v in sched_choices:
                for reshard in reshard_choices:
                    for ac in ac_choices:
                        sacs = (options("sac", ["all_mm", "every_other_mm"]) if ac == "selective"
                                else ["all_mm"])
                        for sac in sacs:
                            try:
                                cand = replace(plan, mbs=mbs, ac=ac, sac=sac, schedule=schedule,
                                               virtual_stages=v, reshard_after_forward=reshard)
                            except ValueError:
                                continue
                            if cand.broken_rules(model, B, cluster.gpus):
                                continue
                            est = estimate(model, cl, cand, seq_len=S, global_batch=B)
                            out.considered += 1
                            if out.smallest is None or est.memory_total < out.smallest.memory_total:
                                out.smallest = est
                            if est.fits and (out.best is None or _rank_key(est) < _rank_key(out.best)):
                                out.best, out.kernels = est, cl.kernels
    return out


@dataclass
class Completion:
    """What :func:`complete` found for one set of degrees."""

    best: Estimate | None          #: the fastest fitting layout, or None when none fits
    smallest: Estimate | None      #: the least memory-hungry layout evaluated
    considered: int                #: layouts evaluated
    kernels: str                   #: the kernel stack of ``best`` (the cluster's when none fits)


def _rank_key(est: Estimate):
    """Best tokens/s per GPU first (4 significant digits, so float noise does not decide); then the
    simpler layout (fewer mesh dimensions in use, cp and pp last), then less memory."""
    p = est.plan
    used = sum(d > 1 for d in (p.dp_replicate, p.dp_shard, p.cp, p.tp, p.pp, p.ep))
    return (-float(f"{est.tokens_per_s_per_gpu:.4g}"), used, p.cp, p.pp, est.memory_total)


def _count(counter: dict[str, int], reason: str) -> None:
    counter[reason] = counter.get(reason, 0) + 1


__all__ = ["search", "complete", "Completion", "SEARCHED_KNOBS", "SearchResult", "candidate_degrees", "divisors"]
