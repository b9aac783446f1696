"""``gem plan``: pick FSDP/HSDP x TP x EP x CP x PP for a model on a cluster, or evaluate one layout.

    gem plan --model PRESET|FILE.toml --gpus N --gpus-per-node G --gpu h100|h200|b200|a100
             [--seq-len S] [--global-batch SEQUENCES] [--top K] [--json]
             [--degrees dp_shard=32,tp=8,...] [--cluster FILE.toml]
             [--kernels fused|eager|compiled-blocks|eager-torch-rmsnorm] [--calibrate]
    gem plan --validate

With ``--degrees`` the knobs the text does not set (micro-batch, activation checkpointing and its
selective policy, schedule and virtual stages, FSDP resharding, and the kernel stack unless
``--kernels`` gives it) are searched, and the fastest layout that fits is shown.

Exit codes: 0 a plan was found (or the given layout is feasible); 2 bad input or nothing fits
(the explanation names every broken rule).
"""
from __future__ import annotations

import argparse
import json
import sys

from gemcore.planner import cost as cost_model
from gemcore.planner.cluster import GPUS, KERNEL_STACKS, Cluster, load_cluster, make_cluster
from gemcore.planner.models import PRESETS, describe, load_model
from gemcore.planner.plan import Plan, PlanError
from gemcore.planner.search import SEARCHED_KNOBS, complete, search


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PRESET|FILE.toml",
                   help=f"a preset ({', '.join(PRESETS)}) or a TOML model file")
    p.add_argument("--gpus", type=int, metavar="N", help="GPUs in all (required unless --cluster gives it)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="GPUs per node (default: 8)")
    p.add_argument("--gpu", choices=sorted(GPUS), help="GPU kind (default h100, or the cluster file's)")
    p.add_argument("--cluster", metavar="FILE.toml", help="cluster file: GPU overrides, network tiers")
    p.add_argument("--kernels", choices=KERNEL_STACKS,
                   help="how non-matmul work runs: fused (torch.compile / fused kernels, the default), "
                        "eager (one PyTorch kernel per op) or compiled-blocks (torch.compile on the "
                        "transformer blocks only, loss and optimizer eager, as TorchTitan compiles) or "
                        "eager-torch-rmsnorm (eager, each RMSNorm torch's one-kernel F.rms_norm on CUDA); "
                        "the cost model counts their memory traffic")
    p.add_argument("--seq-len", type=int, metavar="S", help="sequence length (GEM: longest history)")
    p.add_argument("--global-batch", type=int, metavar="SEQUENCES",
                   help="sequences (users) per optimizer step (default: the preset's per-GPU batch x GPUs; "
                        "for LLMs at most 4M tokens, 4,194,304 // seq-len sequences, as Llama 3 405B "
                        "started its pre-training)"),
    p.add_argument("--top", type=int, default=5, metavar="K", help="plans to show (default 5)")
    p.add_argument("--degrees", metavar="dp_shard=..,tp=..",
                   help="evaluate this layout instead of searching (keys: dp_replicate, dp_shard, tp, cp, "
                        "ep, pp, mbs, ac=none|selective|full, sac=all_mm|every_other_mm (ac=selective "
                        "keeps every matmul output, gemcore's default, or recomputes every second one, "
                        "TorchTitan's op policy), schedule=1F1B|interleaved, v, reshard); knobs not "
                        "given are searched")
    p.add_argument("--calibrate", action="store_true",
                   help="measure GEMM, attention, memory and (under torchrun) collective rates on this "
                        "machine and plan with them")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--validate", action="store_true",
                   help="print the planner's prediction against each published run it is validated "
                        "on (Llama 3 405B, TorchTitan), given only what each source publishes")


def build_cluster(args: argparse.Namespace) -> Cluster:
    if args.cluster:
        return load_cluster(args.cluster, gpus=args.gpus, gpus_per_node=args.gpus_per_node, gpu=args.gpu,
                            kernels=getattr(args, "kernels", None))
    if args.gpus is None:
        raise ValueError("--gpus is required (or a --cluster file that gives gpus)")
    return make_cluster(args.gpu or "h100", args.gpus, args.gpus_per_node,
                        kernels=getattr(args, "kernels", None) or "fused")


def run(args: argparse.Namespace) -> int:
    if args.validate:
        from gemcore.planner.validation import table

        print("\n".join(table()))
        return 0
    if not args.model:
        raise ValueError("--model is required (or --validate)")
    for flag in ("seq_len", "global_batch", "top"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {value}")
    model = load_model(args.model)
    cluster = build_cluster(args)
    calibration = None
    if args.calibrate:
        from gemcore.planner.calibrate import calibrate_cluster, measure

        cluster, calibration = calibrate_cluster(
            cluster, measure(model, seq_len=args.seq_len or model.seq_len), spec=model)
    seq_len = args.seq_len or model.seq_len
    global_batch = args.global_batch or model.default_global_batch(cluster.gpus, seq_len)
    context = {"model": model.name, "model_summary": describe(model), "gpus": cluster.gpus,
               "gpus_per_node": cluster.gpus_per_node, "gpu": cluster.gpu.name, "seq_len": seq_len,
               "global_batch": global_batch}
    if calibration:
        context["calibration"] = calibration
    if args.degrees:
        return _evaluate(args, model, cluster, seq_len, global_batch, context)
    result = search(model, cluster, seq_len=seq_len, global_batch=global_batch, top=args.top)
    if not result.plans:
        reasons = _no_plan_reasons(result, cluster, model)
        _emit(args, {**context, "plans": [], "infeasible": reasons}, reasons)
        return 2
    out = {**context, "plans": [e.to_dict() for e in result.plans], "considered": result.considered,
           "rejected": result.rejected, "why": explain(result.plans)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_plans(out, result.plans)
    return 0


def _evaluate(args, model, cluster, seq_len, global_batch, context) -> int:
    try:
        plan, given = Plan.parse_given(args.degrees)
    except PlanError as exc:
        raise ValueError(str(exc)) from None
    problems = plan.violations(model, global_batch, cluster.gpus)
    if problems:
        _emit(args, {**context, "plans": [], "infeasible": problems}, problems)
        return 2
    kernels_given = args.kernels is not None or args.cluster is not None
    found = complete(model, cluster, plan, given, seq_len=seq_len, global_batch=global_batch,
                     kernels_given=kernels_given)
    searched = [k for k in SEARCHED_KNOBS if k not in given and (k != "kernels" or not kernels_given)]
    context["searched"] = searched
    context["kernels"] = found.kernels
    est = found.best or found.smallest or cost_model.estimate(model, cluster, plan, seq_len=seq_len,
                                                              global_batch=global_batch)
    if found.best is None:
        reasons = [f"needs {est.memory_total / 1e9:.1f} GB per GPU ("
                   + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in est.memory.items())
                   + f"), more than the {est.memory_limit / 1e9:.1f} GB allowed "
                   f"({cost_model.MEMORY_HEADROOM:.0%} of {cluster.gpu.hbm_gb:g} GB)"]
        _emit(args, {**context, "plans": [], "infeasible": reasons, "estimate": est.to_dict()}, reasons,
              est)
        return 2
    out = {**context, "plans": [est.to_dict()]}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_plans(out, [est])
    return 0


def _no_plan_reasons(result, cluster, model) -> list[str]:
    reasons = []
    if result.considered == 0:
        reasons.append(f"no layout of {cluster.gpus} GPUs satisfies the rules for {model.name}: "
                       + "; ".join(f"{k}: {v} layouts" for k, v in result.rejected.items()))
    else:
        reasons.append(f"none of {result.considered} layouts fits: "
                       + "; ".join(f"{k}: {v}" for k, v in result.rejected.items()))
    if result.smallest_memory is not None:
        s = result.smallest_memory
        reasons.append(f"the least memory-hungry layout ({_degrees_text(s.plan)}, ac={s.plan.ac}) needs "
                       f"{s.memory_total / 1e9:.1f} GB per GPU of {s.memory_limit / 1e9:.1f} GB allowed")
    return reasons


def _emit(args, payload: dict, reasons: list[str], est=None) -> None:
    if args.json:
        print(json.dumps(payload, indent=2))
        return
    print(f"gem plan: no feasible plan for {payload['model']} on {payload['gpus']} x {payload['gpu']}:",
          file=sys.stderr)
    for r in reasons:
        print(f"  - {r}", file=sys.stderr)
    if est is not None:
        _print_plans(payload, [est], stream=sys.stderr)


def explain(plans) -> list[str]:
    """Why the best plan wins: where its groups sit, what it spends time on, versus the next best."""
    best = plans[0]
    p = best.plan
    lines = [f"best: {_degrees_text(p)}, mbs={p.mbs}, ac={p.ac}, {p.schedule}"
             + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
             + f"; inside a node: {', '.join(best.intra_node) or 'nothing'}"
             + f"; across nodes: {', '.join(best.inter_node) or 'nothing'}"]
    comm = sum(best.comm_exposed_s.values())
    lines.append(f"step {best.step_time_s:.3g} s = compute {best.compute_s:.3g} s"
                 + (f" (of which host overhead {best.host_overhead_s:.3g} s)"
                    if best.host_overhead_s else "")
                 + f" + exposed comm {comm:.3g} s"
                 + (f" + bubble {best.bubble_s:.3g} s" if best.bubble_s else "")
                 + (f" (largest: {max(best.comm_exposed_s, key=best.comm_exposed_s.get)})" if comm else ""))
    if len(plans) > 1:
        nxt = plans[1]
        gap = 1 - nxt.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
        lines.append(f"runner-up {_degrees_text(nxt.plan)} (ac={nxt.plan.ac}) is {gap:.1%} slower")
    return lines


def _degrees_text(plan: Plan) -> str:
    parts = [f"{k}={v}" for k, v in plan.degrees().items() if v > 1]
    return " × ".join(parts) or "single GPU"


def _print_plans(out: dict, plans, stream=None) -> None:
    stream = stream or sys.stdout
    w = stream.write
    w(f"{out['model_summary']}\n{out['gpus']} x {out['gpu']} ({out['gpus_per_node']} per node), "
      f"seq {out['seq_len']}, global batch {out['global_batch']}\n")
    if out.get("searched"):
        w(f"searched (not given): {', '.join(out['searched'])}; kernels {out['kernels']}\n")
    if out.get("calibration"):
        w(f"calibrated: {out['calibration']}\n")
    w(f"{'#':>2} {'degrees':<44} {'mbs':>4} {'ac':<9} {'sched':<14} {'mem GB (p/g/o/a)':<26} "
      f"{'step s (comp+comm+bub)':<26} {'tok/s/GPU':>10} {'MFU':>6}  intra-node\n")
    for i, est in enumerate(plans, 1):
        d = est.to_dict()
        mem = d["memory_breakdown_gb"]
        p = est.plan
        sched = p.schedule + (f" x{p.virtual_stages}" if p.virtual_stages > 1 else "")
        mem_text = (f"{d['memory_gb']:.1f} ({mem['parameters']:.1f}/{mem['gradients']:.1f}/"
                    f"{mem['optimizer']:.1f}/{mem['activations']:.1f})")
        comm = sum(est.comm_exposed_s.values())
        time_text = f"{est.step_time_s:.3g} ({est.compute_s:.3g}+{comm:.2g}+{est.bubble_s:.2g})"
        ac_text = p.ac if p.sac == "all_mm" else f"{p.ac} (sac={p.sac})"
        w(f"{i:>2} {_degrees_text(p):<44} {p.mbs:>4} {ac_text:<9} {sched:<14} {mem_text:<26} {time_text:<26} "
          f"{est.tokens_per_s_per_gpu:>10.1f} {est.mfu:>6.1%}  {','.join(est.intra_node) or '-'}\n")
    w("  mem: the peak; with one micro-batch per step it holds p + o + the larger of g and a (the "
      "backward frees activations as it makes gradients), else all four\n")
    for line in out.get("why", []):
        w(f"  {line}\n")
