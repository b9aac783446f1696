"""Train a small GemModel a few steps under a plan and print the losses and the global gradient norms
before clipping (one JSON line, rank 0).

    torchrun --nproc-per-node 4 -m gemcore.bench.planner_smoke --degrees dp_shard=2,tp=2 --steps 3
    torchrun --nproc-per-node 4 -m gemcore.bench.planner_smoke --degrees dp_shard=2,pp=2,mbs=2 --blocks 4
    python -m gemcore.bench.planner_smoke --steps 3          # one process: the reference losses
    python -m gemcore.bench.planner_smoke --device cuda --predict --hidden 512 --blocks 4 --max-len 512
    python -m gemcore.bench.planner_smoke --device cuda --predict --repeats 5 ...   # medians of 5 pairs

Every run draws the same model initialisation and the same global batches (users
``[s*B, (s+1)*B)`` at step s, split over the data-parallel ranks as the ``random`` sampler does),
so losses and gradient norms of any plan must match the single-process run up to reduction order
(the norms catch a wrongly scaled gradient that AdamW's scale invariance would hide in the losses). Used by the tests
and to check a plan on a launcher before a long job.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gemcore.bench.planner_smoke")
    ap.add_argument("--degrees", default="", help="plan degrees (default: every rank in dp_shard)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="global batch, users")
    ap.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense MLP)")
    ap.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: off)")
    ap.add_argument("--same-batch", action="store_true", help="train on the first batch every step")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--max-len", type=int, default=24, help="longest history")
    ap.add_argument("--mx", action="store_true", help="precision mxfp8: the linear layers in MX (the "
                    "precision plugin's policy, applied before the plan as gem train does)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                    help="cpu: fp32, reference attention (any number of gloo ranks); cuda: one process, "
                         "bf16 weights, Triton attention")
    ap.add_argument("--gc-every", type=int, default=None,
                    help="Python's automatic garbage collection off, generations 0-1 collected every N "
                         "steps (default: gem train's train.gc_every; 0: automatic collection)")
    ap.add_argument("--predict", action="store_true",
                    help="also calibrate this machine (gem plan --calibrate's measurements) and print the "
                         "planner's predicted step time beside the measured mean (after an untimed pass over the same batches)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="with --predict: this many pairs of (timed steps, calibration) in turn, each pair "
                         "adjacent in time; the medians of the measured and the predicted step are compared")
    args = ap.parse_args(argv)

    from gemcore.config import AttentionConfig, ModelConfig, TrainConfig
    from gemcore.data.synthetic import make_synthetic
    from gemcore.gc_schedule import ScheduledGC
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel
    from gemcore.planner.plan import Plan
    from gemcore.parallel.planned import PlannedParallelism, launch_env
    from gemcore.precision import flush_denormals

    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.repeats > 1 and not args.predict:
        ap.error("--repeats needs --predict (it repeats the timed steps and the calibration in turn)")
    if args.gc_every is not None and args.gc_every < 0:
        ap.error(f"--gc-every must be >= 0 (0: automatic collection), got {args.gc_every}")
    env = launch_env()
    if args.device == "cuda" and (env["world_size"] > 1 or not torch.cuda.is_available()):
        ap.error("--device cuda runs one process on a machine with a CUDA GPU")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    plan = Plan.parse(args.degrees) if args.degrees else Plan(dp_shard=env["world_size"])
    par = PlannedParallelism(plan, env, device=args.device)
    cfg = ModelConfig(num_items=300, hidden=args.hidden, num_blocks=args.blocks, num_heads=4, mlp_ratio=2,
                      moe_experts=args.experts, moe_top_k=2)
    torch.manual_seed(0)
    backend = "triton" if args.device == "cuda" else "reference"
    model = GemModel(cfg, make_attention(AttentionConfig(), backend=backend)).to(dtype=dtype)
    if args.mx:
        from gemcore.config import PrecisionConfig
        from gemcore.precision.mx import make_mx_policy

        model = make_mx_policy(PrecisionConfig(impl="mxfp8")).apply(model, fsdp_size=par.fsdp_size)
    model = par.apply(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_synthetic(num_users=args.batch * args.steps, num_items=cfg.num_items,
                          num_actions=cfg.num_actions, max_len=args.max_len, num_candidates=2, num_clusters=4,
                          kind="uniform", seed=0)
    import time

    def step_users(step: int) -> list[int]:
        """The users of step ``step``'s global batch (every rank's)."""
        first = 0 if args.same_batch else step * args.batch
        return list(range(first, first + args.batch))

    issued = []                                   # per timed step: host seconds of each phase

    def train_step(step: int) -> tuple[float, float | None, float]:
        """One optimizer step on step ``step``'s global batch: (loss, gradient norm, seconds). The
        batch is built and on the device before the clock starts (a DataLoader's workers prefetch
        it; the planner does not model input work). The host clock at the phase borders (no sync:
        on a GPU, when the host had issued each phase) goes to ``issued``."""
        batch = data.__getitems__(step_users(step)[par.rank::par.world_size]).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if hasattr(model, "forward_backward"):   # a pipeline: forward and backward interleave
            loss = model.forward_backward(batch)
            t1 = t2 = time.perf_counter()
        else:
            loss = model.loss(batch)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
        # the norm stays on the device until the step's one sync (the loss, last), as in the
        # trainer: a sync between backward and optimizer would expose the optimizer's host time
        norm = par.clip_grad_norm_(model.parameters(), args.clip) if args.clip else None
        optimizer.step()
        t3 = time.perf_counter()
        loss = float(par.all_reduce_mean(loss.detach()))
        seconds = time.perf_counter() - t0
        issued.append({"forward": t1 - t0, "backward": t2 - t1, "after": t3 - t2})
        return loss, None if norm is None else float(norm), seconds

    gc_every = TrainConfig().gc_every if args.gc_every is None else args.gc_every

    def timed_pass(warm_up: bool) -> tuple[list[float], list[float], list[float]]:
        """The timed steps (after an untimed pass over the same batches if ``warm_up``): their
        losses, gradient norms and seconds; ``issued`` holds their host phases."""
        losses, grad_norms, step_s = [], [], []
        # as gem train runs its steps (run.flush_denormals, train.gc_every)
        with flush_denormals(), ScheduledGC(gc_every) as gc_schedule:
            if warm_up:
                # Triton compiles a kernel variant for each new length's divisibility, which is not
                # the steady state the planner predicts
                for step in range(args.steps):
                    train_step(step)
            issued.clear()
            for step in range(args.steps):
                loss, norm, seconds = train_step(step)
                gc_schedule.step(step + 1)
                losses.append(loss)
                step_s.append(seconds)
                if norm is not None:
                    grad_norms.append(norm)
        return losses, grad_norms, step_s

    losses, grad_norms, step_s = timed_pass(warm_up=args.predict)
    out = {"plan": par.describe(), "losses": losses, "grad_norms": grad_norms}
    if args.mx:
        from gemcore.kernels.mx_fsdp import MXShardedWeight

        weights = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        # MX layers whose weight FSDP2 all-gathered in MX (cast from the master shard this run)
        out["mx_gathered"] = sum(isinstance(w, MXShardedWeight) and w.casts > 0 for w in weights)
    if args.predict:
        moments = []                              # E[L], E[L²] of each rank's share of each step
        for step in range(args.steps):
            everyone = data.__getitems__(step_users(step))
            n = (everyone.offsets.diff() + everyone.cand_offsets.diff()).double()
            moments.append([(float(n[r::par.world_size].mean()), float((n[r::par.world_size] ** 2).mean()))
                            for r in range(par.world_size)])
        first_batch = data.__getitems__(step_users(0)[par.rank::par.world_size])
        lengths = (first_batch.offsets.diff() + first_batch.cand_offsets.diff()).tolist()
        pairs = []
        for repeat in range(args.repeats):
            if repeat:
                step_s = timed_pass(warm_up=False)[2]
            pair = _predict(plan, cfg, args, env, step_s, lengths, moments, backend, dtype)
            # beside the planner's issued host time: what this run's host issued, per phase (a GPU
            # runs ahead of none of it; on a CPU it is the compute itself)
            pair["host_issued_s_measured"] = {k: sum(s[k] for s in issued) / len(issued) for k in issued[0]}
            pairs.append(pair)
        out.update(pairs[-1])
        if args.repeats > 1:
            out.update(_medians(pairs))
    if env["rank"] == 0:
        print(json.dumps(out), flush=True)
    if par.mesh is not None:
        import torch.distributed as dist

        # every rank past its last collective before any tears down: a rank destroying its gloo
        # groups while a peer still has one in flight aborted that peer (SIGABRT) on a loaded CI box
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _predict(plan, cfg, args, env, step_s: list[float], lengths: list[int],
             moments: list[list[tuple[float, float]]], backend: str, dtype: torch.dtype) -> dict:
    """Calibrated prediction of this run's step time (every rank measures: the collectives need all).

    The calibration runs right after the steps, in the same processes, on this run's first local
    batch (its sequence lengths incl. candidates), the run's attention backend and dtype."""
    import dataclasses

    from gemcore.planner.calibrate import calibrate_cluster, measure
    from gemcore.planner.cluster import make_cluster
    from gemcore.planner.cost import estimate
    from gemcore.planner.models import ModelSpec

    spec = ModelSpec(name="smoke", kind="gem", num_layers=cfg.num_blocks, hidden=cfg.hidden,
                     num_heads=cfg.num_heads, num_kv_heads=cfg.num_heads, ffn=cfg.mlp_ratio * cfg.hidden,
                     seq_len=args.max_len, length_law="uniform", num_candidates=2,
                     embedding_rows=cfg.num_items, num_experts=cfg.moe_experts,
                     top_k=cfg.moe_top_k if cfg.moe_experts else 0)
    # the run is one micro-batch of the local users per step, eager PyTorch kernels
    plan = dataclasses.replace(plan, mbs=max(1, args.batch // plan.dp))
    # GemModel's RMSNorm is F.rms_norm: one kernel on CUDA, the upcast ops on a CPU
    cluster = dataclasses.replace(make_cluster("h100", env["world_size"], env["local_world_size"]),
                                  kernels="eager-torch-rmsnorm" if args.device == "cuda" else "eager")
    rates = measure(spec, lengths=lengths, backend=backend, dtype=dtype)
    cluster, summary = calibrate_cluster(cluster, rates, spec=spec)
    # each step predicted at its own batch's lengths, on the rank whose share costs most (the others
    # wait for it in the collectives); the timed steps ran after a warm-up pass over the same batches
    ests = [max((estimate(spec, cluster, plan, seq_len=args.max_len, global_batch=args.batch,
                          length_moments=m) for m in per_rank), key=lambda e: e.step_time_s)
            for per_rank in moments]
    predicted = sum(e.step_time_s for e in ests) / len(ests)
    measured = sum(step_s) / len(step_s)
    ratios = [e.step_time_s / t for e, t in zip(ests, step_s)]
    est = ests[-1]
    return {"calibration": summary, "step_s_predicted": predicted, "step_s_measured": measured,
            "predicted_over_measured": predicted / measured,
            "per_step_ratio_min_max": [min(ratios), max(ratios)],
            "last_step_predicted_split_s": {"compute": est.compute_s, "host_overhead": est.host_overhead_s,
                                  **est.comm_exposed_s},
            "last_step_predicted_compute_parts_s": est.compute_parts_s,
            "host_issued_s_predicted": est.host_issue_s}


def _medians(pairs: list[dict]) -> dict:
    """The repeated pairs' summary: the median measured and median predicted step and their ratio
    (the comparison), the median of the pairs' own ratios, and each pair's figures.

    A host-bound step on a shared machine is known only to about ±15 % from one second to the
    next (one H200 process: identical 20-step passes measured 12.4-17.2 ms), and its
    calibration alike; a pair's ratio carries both, the medians of repeats neither's outliers."""
    import statistics

    measured = statistics.median(p["step_s_measured"] for p in pairs)
    predicted = statistics.median(p["step_s_predicted"] for p in pairs)
    return {"step_s_measured": measured, "step_s_predicted": predicted,
            "predicted_over_measured": predicted / measured,
            "median_pair_ratio": statistics.median(p["predicted_over_measured"] for p in pairs),
            "pairs": [{k: p[k] for k in ("step_s_measured", "step_s_predicted", "predicted_over_measured")}
                      | {"calibration": {k: v for k, v in p["calibration"].items() if "overhead" in k}}
                      for p in pairs]}


if __name__ == "__main__":
    code = main()
    # Every collective is done and the groups destroyed; skip the interpreter's teardown, where
    # gloo worker threads still holding tensors can abort the process (SIGABRT, "terminate called
    # without an active exception": pytorch/pytorch#179291), seen twice on the loaded CI box
    # after correct runs.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
