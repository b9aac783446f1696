#!/usr/bin/env bash
# Session 15, call 4: planner predicted vs measured step time on one GPU after the host-overhead
# calibration change (slope of 1- and 3-block steps), four sizes (the smallest twice).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
run() {  # name, then smoke arguments
  local name=$1; shift
  timeout 110 python3 -m gemcore.planner.smoke --device cuda --predict "$@" > "$OUT/predict_$name.json" 2> "$OUT/predict_$name.err"
  echo "== $name rc=$? ($*)"
  python3 - "$OUT/predict_$name.json" <<'PY' || tail -5 "$OUT/predict_$name.err"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print({k: (round(d[k], 4) if isinstance(d[k], float) else d[k]) for k in ("step_s_predicted", "step_s_measured", "predicted_over_measured", "per_step_ratio_min_max", "last_step_predicted_split_s")})
print("calibration:", d["calibration"])
PY
}
run small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
run small2 --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
run mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
run large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6
run long --hidden 1024 --blocks 4 --max-len 4096 --batch 32 --steps 6
