#!/usr/bin/env bash
# Session 15, call 5: predicted vs measured on one GPU with the batch built before the clock starts.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for cfg in "small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8" \
           "small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8" \
           "mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6" \
           "large --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6"; do
  set -- $cfg; name=$1; shift
  timeout 110 python3 -m gemcore.planner.smoke --device cuda --predict "$@" > "$OUT/p.json" 2> "$OUT/p.err"
  echo "== $name rc=$? ($*)"
  python3 - "$OUT/p.json" <<'PY' || tail -5 "$OUT/p.err"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print({k: (round(d[k], 4) if isinstance(d[k], float) else d[k]) for k in ("step_s_predicted", "step_s_measured", "predicted_over_measured", "per_step_ratio_min_max", "last_step_predicted_split_s")})
print("calibration:", d["calibration"])
PY
done
