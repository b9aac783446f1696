#!/usr/bin/env bash
# Session 24, GPU call 5: attention.impl=auto (the new default) on the GPU: its tests, then
# `gem train --device cuda` with the defaults (auto: Triton, fp32) beside the old default
# (attention.impl=reference), 100 steps each.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout -s INT 120 python3 -m pytest -q -p no:cacheprovider -rs tests/test_jagged_attention.py -k "auto or plugin_factories or model_trains" 2>&1 | tail -2
for impl in auto reference; do
  timeout 100 gem train --device cuda --max-steps 100 --quiet --name dflt_$impl --set attention.impl=$impl > /tmp/train.log 2>&1
  echo -n "attention.impl=$impl rc=$? "
  python3 - runs/dflt_$impl <<'PY' || tail -5 /tmp/train.log
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
late = sorted(r["tokens_per_s"] for r in rows[len(rows) // 2:][::10])
s = json.load(open(sys.argv[1] + "/summary.json"))
print("second-half median tokens/s:", round(late[len(late) // 2]), "last loss:", rows[-1]["loss"],
      "held-out AUC:", s.get("heldout_auc", s.get("auc")))
PY
done
