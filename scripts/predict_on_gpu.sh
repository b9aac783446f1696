#!/usr/bin/env bash
# One planner predicted-vs-measured run on the GPU: predict_on_gpu.sh NAME SMOKE_ARGS...
# (gemcore.planner.smoke --device cuda --predict; the JSON goes to $OUT/predict_NAME.json).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
name=$1; shift
timeout ${PREDICT_TIMEOUT:-110} python3 -m gemcore.planner.smoke --device cuda --predict "$@" > "$OUT/predict_$name.json" 2> "$OUT/predict_$name.err"
echo "== $name rc=$? ($*)"
python3 - "$OUT/predict_$name.json" <<'PY' || tail -5 "$OUT/predict_$name.err"
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print({k: (round(d[k], 4) if isinstance(d[k], float) else d[k]) for k in ("step_s_predicted", "step_s_measured", "predicted_over_measured", "per_step_ratio_min_max", "last_step_predicted_split_s")})
print("host issued per phase, measured:", {k: round(v, 4) for k, v in d.get("host_issued_s_measured", {}).items()},
      "predicted:", {k: round(v, 4) for k, v in d.get("host_issued_s_predicted", {}).items()})
print("calibration:", d["calibration"])
if "pairs" in d:
    print("repeats: median measured", round(d["step_s_measured"] * 1e3, 2), "ms, median predicted",
          round(d["step_s_predicted"] * 1e3, 2), "ms, ratio of medians", round(d["predicted_over_measured"], 3),
          "median pair ratio", round(d["median_pair_ratio"], 3), "pairs (measured ms, ratio, layer ms):",
          [(round(p["step_s_measured"] * 1e3, 2), round(p["predicted_over_measured"], 3),
            round(p["calibration"]["layer_overhead_s"] * 1e3, 2)) for p in d["pairs"]])
PY
