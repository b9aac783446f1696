#!/usr/bin/env bash
# Prepared in session 22 for the next session: gem train on the GPU with the fast path (jfa, bf16),
# hidden 512 x 4 blocks, with garbage collection on gem train's schedule (train.gc_every=50) and on
# Python's automatic collector (0), twice each, alternating; per-window tokens/s of each run.
# (Session 22's call 7 ran the defaults, attention.impl=reference in fp32, whose per-sequence loop
# is the whole step.)
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for i in 1 2; do for gc in 50 0; do
  timeout 150 gem train --device cuda --parallel auto --max-steps 400 --quiet --name gc${gc}_$i \
    --set attention.impl=jfa --set precision.impl=bf16 --set train.gc_every=$gc \
    --set model.hidden=512 --set model.num_blocks=4 --set model.num_heads=4 > /tmp/train.log 2>&1
  echo "gc_every=$gc run $i rc=$?"
  python3 - runs/gc${gc}_$i <<'PY' || tail -5 /tmp/train.log
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"loss"' in l]
windows = rows[::10]
late = [r["tokens_per_s"] for r in windows[len(windows) // 2:]]
print("tokens/s per 10-step window:", [round(r["tokens_per_s"]) for r in windows],
      "second half median:", round(sorted(late)[len(late) // 2]), "last loss:", rows[-1]["loss"])
PY
done; done
