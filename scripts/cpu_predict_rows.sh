#!/usr/bin/env bash
# The planner's CPU predicted-vs-measured rows, one line each:
#   cpu_predict_rows.sh RANKS:HIDDEN:BLOCKS:MAX_LEN:REPEATS ...
# (gemcore.planner.smoke --predict --steps 6, one thread a rank, any GPU hidden; RANKS > 1 under
# torchrun). PYTHON picks the interpreter (default python3).
set -u
py=${PYTHON:-python3}
summary='import json, sys
d = json.loads([l for l in sys.stdin if l.startswith("{")][-1]); c = d["calibration"]
pairs = [round(p["predicted_over_measured"], 3) for p in d.get("pairs", [])]
m, p, r = d["step_s_measured"], d["step_s_predicted"], d["predicted_over_measured"]
split = {k: round(v * 1e3, 1) for k, v in d["last_step_predicted_split_s"].items()}
print(f"measured {m:.4f} s predicted {p:.4f} s ratio {r:.3f} pairs {pairs} split {split}",
      "rs_factor", c.get("reduce_scatter_factor"), "copy GB/s", round(c.get("fsdp_copy_bytes_per_s", 0) / 1e9, 1))'
for spec in "$@"; do
  IFS=: read -r n hidden blocks max_len repeats <<< "$spec"
  if [ "$n" = 1 ]; then launch="$py -m gemcore.planner.smoke"
  else launch="$py -m torch.distributed.run --nproc-per-node $n -m gemcore.planner.smoke"; fi
  echo -n "ranks $n hidden $hidden blocks $blocks max-len $max_len: "
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout 200 $launch --predict --repeats "$repeats" --steps 6 \
      --hidden "$hidden" --blocks "$blocks" --max-len "$max_len" 2>/dev/null | $py -c "$summary" || echo "failed rc=$?"
done
