#!/usr/bin/env bash
# Session 22, GPU call 7: gem train on the GPU with this session's clip and GC schedule
# (--parallel auto: the planned parallelism's clip), steps/s with the schedule and without it;
# the GC-schedule tests.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for gc in 50 0; do
  timeout 120 gem train --device cuda --parallel auto --max-steps 200 --quiet --name gc$gc --set train.gc_every=$gc \
    --set model.hidden=512 --set model.num_blocks=4 --set model.num_heads=4 > /tmp/train_$gc.log 2>&1; echo "gc_every=$gc rc=$?"
  python3 -c "import json; d=json.load(open('runs/gc$gc/summary.json')); print({k: d[k] for k in d if any(s in k for s in ('step', 'tokens', 'auc', 'loss', 'mfu', 'wall'))})" || tail -5 /tmp/train_$gc.log
done
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_gc_schedule.py 2>&1 | tail -2
