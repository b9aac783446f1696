#!/usr/bin/env bash
# Prepared in session 22 for the next session: why did `gem train --device cuda --parallel auto`
# (hidden 512 x 4 blocks, default heavytail data) take 0.42-0.44 s per step over 200 steps when
# the planner smoke's steps of a like model take ~12 ms? Per logged row (10 steps) tokens/s and
# time: if the first rows carry the time (Triton compiling kernel variants for new lengths) the
# later rows are fast; then a profile of 5 late steps.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 gem train --device cuda --parallel auto --max-steps 300 --quiet --name slow \
  --set model.hidden=512 --set model.num_blocks=4 --set model.num_heads=4 > /tmp/train.log 2>&1; echo "rc=$?"
python3 - <<'PY'
import json
rows = [json.loads(l) for l in open("runs/slow/metrics.jsonl") if '"loss"' in l]
for r in rows[::10] + rows[-3:]:
    print(r["step"], round(r["tokens_per_s"]), round(r["time_s"], 2))
PY
ls ~/.triton/cache 2>/dev/null | wc -l
