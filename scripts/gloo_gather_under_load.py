"""Does a gloo collective on a CPU without spare cores run slower beside compute than alone?

Two ranks (torchrun --nproc-per-node 2), one thread each: an all-gather of a hidden-256 block's
shard (327,936 floats) alone, 30 GEMMs (512^2) alone, the GEMMs then the gather, and the gather
started asynchronously before the GEMMs (as FSDP2 prefetches); and a reduce-scatter alone. Prints
what the gather adds in each case (ms per call, rank 0).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 scripts/gloo_gather_under_load.py
"""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
r = dist.get_rank(); torch.set_num_threads(1)
shard = torch.randn(327936); out = torch.empty(2 * 327936)
a = torch.randn(512, 512); b = torch.randn(512, 512)
def gemms(n):
    for _ in range(n): a @ b
def timeit(fn, reps=20):
    dist.barrier(); t = time.perf_counter()
    for _ in range(reps): fn()
    dist.barrier(); return (time.perf_counter() - t) / reps * 1e3
for _ in range(3): dist.all_gather_into_tensor(out, shard); gemms(5)
g = timeit(lambda: dist.all_gather_into_tensor(out, shard))
c = timeit(lambda: gemms(30))
both = timeit(lambda: (gemms(30), dist.all_gather_into_tensor(out, shard)))
# asynchronous gather overlapped with the GEMMs, as FSDP2 prefetches
def overlapped():
    w = dist.all_gather_into_tensor(out, shard, async_op=True); gemms(30); w.wait()
ov = timeit(overlapped)
rs_in = torch.randn(2 * 327936); rs_out = torch.empty(327936)
rs = timeit(lambda: dist.reduce_scatter_tensor(rs_out, rs_in))
if r == 0:
    print(f"all-gather alone {g:.2f} ms; GEMMs alone {c:.2f} ms; GEMMs then gather {both:.2f} ms "
          f"(gather adds {both - c:.2f}); gather overlapped with GEMMs {ov:.2f} ms (adds {ov - c:.2f}); reduce-scatter alone {rs:.2f} ms")
dist.destroy_process_group()
