#!/usr/bin/env bash
# Session 14: the hand-pipelined forward experiment, then Nsight Compute sections of the attention
# kernels (softmax fwd, dQ, dK/dV; silu fwd, dQ, dK/dV) on dense95.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 250 python3 scripts/attn_pipelined_experiment.py 220 2>&1 | tee "$OUT/pipe.txt" | cut -c1-160
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
timeout 270 "$NCU" --clock-control none --kernel-name regex:_jagged_attn --launch-skip 3 --launch-count 6 \
  --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SchedulerStats \
  --section InstructionStats \
  python3 scripts/attn_profile_driver.py > "$OUT/ncu.txt" 2>&1
echo "ncu rc=$?"
grep -E "_jagged_attn|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per Thread|Achieved Occupancy|Theoretical Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Dynamic Shared|Block Limit" "$OUT/ncu.txt" | head -100
