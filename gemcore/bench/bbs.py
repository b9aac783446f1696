"""Load balance of jagged batches: random sharding vs GEM's rule vs gemcore's ``bbs``, and BBS planning time.

For each rank count W, a dataset of ``W * per_rank * steps`` samples with lengths from the
workload's law (docs/benchmarks.md, "Workloads") is drawn (one torch generator seeded once); each step's global batch of
``W * per_rank`` samples is assigned to ranks three ways, and the per-rank cost (the model's FLOP
count per sample by default) gives max/mean, averaged over the steps:

* ``random``: the shuffled batch dealt rank by rank (the ``random`` sampler's rule);
* ``gem_rule``: GEM's published rule: ``sub_batch``-sample sub-batches of the shuffled batch,
  sorted by cost, heaviest paired with lightest (serpentine deal);
* ``bbs``: :class:`gemcore.data.BaseBatchShuffler`.

``plan_ms`` is the wall time one rank spends planning a step (the global assignment plus its own
sub-batches), single-threaded NumPy on the host: the median over steps of the fastest of 3 runs; ``epoch_setup_ms`` is the once-per-epoch
permutation (reported apart: divide by ``steps_per_epoch`` for its share of a step). The anchor is
the ``random`` column of the same run; the goal is bbs <= 1.02 at 64 ranks on heavytail with 1024
samples per rank, planning in < 5 ms per step.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np
import torch

from gemcore.data.bbs import NAMED_COSTS, BaseBatchShuffler, gem_rule_loads, random_loads
from gemcore.data.workloads import WORKLOAD_MAX_LEN, history_lengths

REPEATS = 3  # plan_ms: median over steps of the fastest of REPEATS timings (less noise from other load)
GOAL = {"ranks": 64, "workload": "heavytail", "max_over_mean": 1.02, "plan_ms": 5.0}


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks: expected comma-separated ints, got {text!r}") from None
    if not ranks or any(r <= 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"--ranks: expected positive ints, got {text!r}")
    return ranks


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=_ranks, default=[8, 64, 512], metavar="W,W,...",
                   help="rank counts (default 8,64,512)")
    p.add_argument("--workload", choices=sorted(WORKLOAD_MAX_LEN), default="heavytail")
    p.add_argument("--per-rank", type=_positive, default=1024, metavar="N", help="samples per rank per step")
    p.add_argument("--steps", type=_positive, default=5, metavar="S", help="steps averaged per rank count")
    p.add_argument("--sub-batch", type=_positive, default=128, metavar="N", help="GEM rule's sub-batch size")
    p.add_argument("--cost", choices=sorted(NAMED_COSTS), default="attention",
                   help="per-sample cost (attention: the default model's FLOP count)")
    p.add_argument("--max-len", type=_positive, default=None, metavar="L", help="longest length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def measure(ranks: int, args) -> dict:
    max_len = args.max_len or WORKLOAD_MAX_LEN[args.workload]
    gen = torch.Generator().manual_seed(args.seed)
    global_batch = ranks * args.per_rank
    lengths = history_lengths(args.workload, global_batch * args.steps, max_len, gen)
    shuffler = BaseBatchShuffler(lengths, world_size=ranks, rank=0, global_batch=global_batch,
                                 sub_batch=args.sub_batch, seed=args.seed, cost=args.cost)
    t0 = time.perf_counter()
    shuffler.step_samples(0, 0)  # the epoch's permutation (and its key/cost layout): once per epoch
    epoch_setup_s = time.perf_counter() - t0
    ratio = {"random": [], "gem_rule": [], "bbs": []}
    plan_s = []
    for step in range(args.steps):
        repeats = []
        for _ in range(REPEATS):  # planning is a pure function of (epoch, step): time it a few times
            t0 = time.perf_counter()
            plan = shuffler.plan(0, step)
            shuffler.local_batch(plan)
            repeats.append(time.perf_counter() - t0)
        plan_s.append(min(repeats))
        costs = shuffler.costs[shuffler.step_samples(0, step)]
        for name, loads in (("random", random_loads(costs, ranks)),
                            ("gem_rule", gem_rule_loads(costs, ranks, args.sub_batch)),
                            ("bbs", plan.rank_cost)):
            ratio[name].append(float(loads.max() / loads.mean()))
    return {"ranks": ranks, **{k: float(np.mean(v)) for k, v in ratio.items()},
            "plan_ms": 1e3 * float(np.median(plan_s)), "samples_per_step": global_batch,
            "epoch_setup_ms": 1e3 * epoch_setup_s, "steps_per_epoch": shuffler.steps_per_epoch()}


def run(args: argparse.Namespace) -> int:
    results = [measure(w, args) for w in args.ranks]
    meta = {"workload": args.workload, "per_rank": args.per_rank, "steps": args.steps,
            "sub_batch": args.sub_batch, "cost": args.cost,
            "max_len": args.max_len or WORKLOAD_MAX_LEN[args.workload],
            "host": f"{platform.processor() or platform.machine()}, numpy {np.__version__}",
            "anchor": "GEM before BBS: heaviest rank ~15% above the mean (max/mean ~1.15)",
            "goal": GOAL}
    if args.json:
        print(json.dumps({"results": results, **meta}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=(f"gem bench bbs: {args.workload} (max len {meta['max_len']}), {args.per_rank} "
                         f"samples/rank, cost={args.cost}, mean of {args.steps} steps"))
    for col in ("ranks", "random max/mean", "GEM rule max/mean", "bbs max/mean", "bbs plan ms/step",
                "epoch ms / steps"):
        table.add_column(col, justify="right")
    for r in results:
        table.add_row(str(r["ranks"]), f"{r['random']:.4f}", f"{r['gem_rule']:.4f}", f"{r['bbs']:.4f}",
                      f"{r['plan_ms']:.2f}", f"{r['epoch_setup_ms']:.0f} / {r['steps_per_epoch']}")
    console = Console()
    console.print(table)
    console.print(f"anchor: {meta['anchor']}; goal: bbs <= {GOAL['max_over_mean']} at {GOAL['ranks']} "
                  f"ranks on {GOAL['workload']}, plan < {GOAL['plan_ms']} ms/step")
    return 0
