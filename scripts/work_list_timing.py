"""Device experiment: the persistent kernels' work-list build (kernels/jagged_work_list.py) on the
anchor workloads: wall time per list when launched back to back (bounded by the host's launch
rate), and the list kernel's own GPU time from the profiler.

    python scripts/work_list_timing.py
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from attn_experiment_harness import workload_inputs  # the module beside this script
from gemcore.kernels.jagged_work_list import work_list


def main() -> None:
    for workload in ("dense95", "heavytail"):
        _, _, _, offsets, max_len, _, _ = workload_inputs(workload, "softmax")
        for from_end in (False, True):
            name = f"{workload} {'key tiles (from_end)' if from_end else 'query tiles'}"
            work_list(offsets, max_len, from_end)
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                work_list(offsets, max_len, from_end)
            end.record()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    work_list(offsets, max_len, from_end)
                torch.cuda.synchronize()
            kernels = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
            detail = ", ".join(f"{k[:40]} {us:.1f} us" for k, us in kernels.items())
            print(f"{name}: {start.elapsed_time(end) / 50 * 1000:.1f} us per list back to back; GPU kernels: {detail}",
                  flush=True)


if __name__ == "__main__":
    main()
