import torch, sys
sys.path.insert(0, "scripts")
from attn_experiment_harness import workload_inputs
from gemcore.kernels.jagged_work_list import work_list
for wl in ["dense95", "heavytail"]:
    q, k, v, off, max_len, flops, kw = workload_inputs(wl, "softmax")
    for fe in (False, True):
        work_list(off, max_len, fe); torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(50): work_list(off, max_len, fe)
        e.record(); torch.cuda.synchronize()
        print(wl, "from_end" if fe else "fwd", f"{s.elapsed_time(e) / 50 * 1000:.1f} us per list (incl. zeros + empty)", flush=True)
