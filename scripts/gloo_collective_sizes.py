"""Gloo's all-gather, reduce-scatter and all-reduce at FSDP2's block sizes, two CPU ranks.

Per size (floats of the unsharded buffer): all-gather into a reused and into a fresh output;
reduce-scatter with a reused output, a fresh one, and a fresh input and output; a fresh copy of
the buffer; an all-reduce of it. Milliseconds per call, rank 0 (15 calls after 3 warm-ups).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/gloo_collective_sizes.py
"""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
torch.set_num_threads(1)
world = dist.get_world_size()


def ms_per_call(fn, reps: int = 15) -> float:
    for _ in range(3):
        fn()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e3


for n in (256, 655872, 1476000):
    shard, full = torch.randn(n // world), torch.randn(n)
    row = {
        "AG": ms_per_call(lambda: dist.all_gather_into_tensor(full, shard)),
        "AG fresh out": ms_per_call(lambda: dist.all_gather_into_tensor(torch.empty(n), shard)),
        "RS": ms_per_call(lambda: dist.reduce_scatter_tensor(shard, full)),
        "RS fresh out": ms_per_call(lambda: dist.reduce_scatter_tensor(torch.empty(n // world), full)),
        "RS fresh in+out": ms_per_call(
            lambda: dist.reduce_scatter_tensor(torch.empty(n // world), torch.empty(n).copy_(full))),
        "fresh copy": ms_per_call(lambda: torch.empty(n).copy_(full)),
        "AR": ms_per_call(lambda: dist.all_reduce(full)),
    }
    if dist.get_rank() == 0:
        print(n, " | ".join(f"{k} {v:.2f}" for k, v in row.items()))
dist.destroy_process_group()
