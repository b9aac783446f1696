"""FSDP2 training step time on each communication backend: same model, same data, same run.

    mpirun -n 4 gem bench comms_step --backends torch,mpi
    torchrun --nproc-per-node 2 -m gemcore.cli.main bench comms_step --device cuda --backends ce

For every repeat, each backend in turn (the order alternates between repeats) becomes
torch.distributed's default process group (``torch``: gloo on CPU, NCCL on CUDA; ``mpi``, ``ce``, a
plugin's: the gemcore process group over that communicator), the same GemModel is built from the
same seed, sharded with FSDP2 over every rank and trained for ``--warmup`` + ``--steps`` steps on the
same batches; then the group is destroyed. Reported per backend: the median step time (host clock
around a whole step, ending with the loss read back, as a caller feels it) over all timed steps of
all repeats, the spread of the repeats' medians (min to max), the ratio to the first backend, and
the largest difference of its losses from the first backend's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gemcore.config import AttentionConfig, ModelConfig


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default="torch,mpi",
                   help="comma list of comms backends (torch: gloo/NCCL; mpi, ce, a plugin's); the first is the anchor")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--steps", type=int, default=10, help="timed steps per backend and repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--users", type=int, default=32, help="global batch in users")
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="the gemcore communicator's per-call agreement check (comms.check)")
    p.add_argument("--json", action="store_true")


def _check(args) -> list[str]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends:
        raise SystemExit("--backends: name at least one backend")
    for name in ("steps", "repeats", "users", "max_len", "hidden", "blocks"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    return backends


def _join(backend: str, comm, launch, prefix: str, device: str) -> None:
    import datetime

    import torch.distributed as dist

    from gemcore.comms import process_group
    from gemcore.comms.rendezvous import job_store

    store = job_store(launch)
    if backend == "torch":
        name = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(name, store=dist.PrefixStore(prefix, store), rank=launch.rank,
                                world_size=launch.world_size, timeout=datetime.timedelta(seconds=300))
    else:
        process_group.init_process_group(comm, prefix=prefix)


def _model_config(args) -> ModelConfig:
    return ModelConfig(num_items=300, hidden=args.hidden, num_blocks=args.blocks, num_heads=4, mlp_ratio=2)


def _train(args, device: torch.device, env: dict, data, launch) -> tuple[list[float], list[float]]:
    """(step seconds of the timed steps, losses of every step) of one FSDP2 run."""
    from gemcore.kernels.jagged_attention import make_attention
    from gemcore.model import GemModel
    from gemcore.parallel.planned import PlannedParallelism
    from gemcore.planner.plan import Plan

    par = PlannedParallelism(Plan(dp_shard=launch.world_size), env, device.type, label="fsdp")
    cfg = _model_config(args)
    torch.manual_seed(0)
    backend = "triton" if device.type == "cuda" else "reference"
    model = GemModel(cfg, make_attention(AttentionConfig(), backend=backend))
    model = par.apply(model, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    times, losses = [], []
    per_rank = args.users // launch.world_size
    for step in range(args.warmup + args.steps):
        users = list(range(step * args.users, (step + 1) * args.users))
        batch = data.__getitems__(users[launch.rank * per_rank:(launch.rank + 1) * per_rank]).to(device)
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = model.loss(batch)
        loss.backward()
        optimizer.step()
        value = float(par.all_reduce_mean(loss.detach()).item())
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(value)
    return times, losses


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from gemcore import comms
    from gemcore.comms.launch import detect
    from gemcore.data import make_synthetic
    from gemcore.parallel.planned import launch_env

    backends = _check(args)
    launch = detect()
    if launch.world_size < 2:
        raise SystemExit("gem bench comms_step runs under a launcher with at least 2 ranks "
                         "(mpirun -n 4 gem bench comms_step ...)")
    if args.users % launch.world_size:
        raise SystemExit(f"--users ({args.users}) must be a multiple of the ranks ({launch.world_size})")
    env = launch_env()
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", env["local_rank"] % torch.cuda.device_count())
        torch.cuda.set_device(device)
    custom = [b for b in backends if b != "torch"]
    if len(set(custom)) > 1:
        raise SystemExit(f"--backends: at most one gemcore backend per run besides torch, got {custom}")
    comm = comms.init(custom[0], timeout_s=120, check=args.check) if custom else None
    data = make_synthetic(num_users=args.users * (args.warmup + args.steps), num_items=300,
                          num_actions=_model_config(args).num_actions,
                          max_len=args.max_len, num_candidates=2, num_clusters=4, kind="uniform", seed=0)
    step_times = {b: [] for b in backends}
    medians = {b: [] for b in backends}
    losses: dict[str, list[float]] = {}
    for repeat in range(args.repeats):
        order = backends if repeat % 2 == 0 else backends[::-1]
        for b in order:
            _join(b, comm, launch, f"bench/{repeat}/{b}", args.device)
            times, run_losses = _train(args, device, env, data, launch)
            dist.barrier()
            dist.destroy_process_group()
            step_times[b] += times
            medians[b].append(statistics.median(times))
            losses.setdefault(b, run_losses)
    anchor = backends[0]
    rows = []
    for b in backends:
        med = statistics.median(step_times[b])
        rows.append({"backend": b, "step_ms": 1e3 * med, "repeat_min_ms": 1e3 * min(medians[b]),
                     "repeat_max_ms": 1e3 * max(medians[b]),
                     "ratio": med / statistics.median(step_times[anchor]),
                     "max_loss_diff": max(abs(x - y) for x, y in zip(losses[b], losses[anchor]))})
    if launch.rank == 0:
        if args.json:
            print(json.dumps({"ranks": launch.world_size, "device": args.device, "rows": rows}))
        else:
            print(f"FSDP2 step, {launch.world_size} ranks on {args.device}, hidden {args.hidden}, "
                  f"{args.blocks} blocks, {args.users} users/step, {args.repeats} repeats x {args.steps} steps, "
                  f"agreement check {'on' if args.check else 'off'}")
            print(f"{'backend':>10} {'step ms':>9} {'repeats (min..max)':>20} {'x ' + anchor:>9} {'loss diff':>10}")
            for r in rows:
                print(f"{r['backend']:>10} {r['step_ms']:9.2f} {r['repeat_min_ms']:9.2f}..{r['repeat_max_ms']:<9.2f} "
                      f"{r['ratio']:9.3f} {r['max_loss_diff']:10.2e}")
    comms.finalize()
    return 0
