#!/usr/bin/env bash
# Session 25, GPU call 4 (final code: FSDP copy rate after a gather): the CPU predicted-vs-measured rows on the device host's CPU cores with the
# GPU hidden (ranks there leave cores spare, unlike the 2-core machine), one rank's collectives
# split into core time and arrival skew; the one-GPU mid and small rows (--repeats 3).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
summary='import json, sys
d = json.loads([l for l in sys.stdin if l.startswith("{")][-1]); c = d["calibration"]
pairs = [round(p["predicted_over_measured"], 3) for p in d.get("pairs", [])]
m, p, r = d["step_s_measured"], d["step_s_predicted"], d["predicted_over_measured"]
split = {k: round(v * 1e3, 1) for k, v in d["last_step_predicted_split_s"].items()}
print(f"measured {m:.4f} s predicted {p:.4f} s ratio {r:.3f} pairs {pairs} split {split}",
      "rs_factor", c.get("reduce_scatter_factor"), "copy GB/s", round(c.get("fsdp_copy_bytes_per_s", 0) / 1e9, 1))'
row() {   # ranks hidden blocks max_len repeats
  local n=$1
  if [ "$n" = 1 ]; then launch="python3 -m gemcore.planner.smoke"
  else launch="python3 -m torch.distributed.run --nproc-per-node $n -m gemcore.planner.smoke"; fi
  echo -n "ranks $n hidden $2 blocks $3 max-len $4: "
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 200 $launch --predict --repeats $5 --steps 6 \
      --hidden $2 --blocks $3 --max-len $4 2>/dev/null | python3 -c "$summary" || echo "failed rc=$?"
}
row 1 256 2 256 3
row 2 256 2 256 3
row 4 256 2 256 3
row 2 512 4 512 2
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 COLLECTIVE_LOG_DIR=/tmp timeout 100 python3 -m torch.distributed.run \
    --nproc-per-node 2 scripts/collective_core_time.py --steps 20 --hidden 256 --blocks 2 --max-len 256 > /dev/null 2>&1
COLLECTIVE_LOG_DIR=/tmp python3 scripts/collective_core_time.py --analyze
export PREDICT_TIMEOUT=150
scripts/predict_on_gpu.sh mid_r --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 --repeats 3 2>&1 | grep -E "==|repeats"
scripts/predict_on_gpu.sh small_r --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20 --repeats 3 2>&1 | grep -E "==|repeats"
