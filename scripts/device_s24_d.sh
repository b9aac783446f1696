#!/usr/bin/env bash
# Session 24, GPU call 4: run.deterministic as committed (new-memory fill off): its GPU test, and
# tokens/s beside plain runs (alternating, twice each); the planner's mid and large rows with
# --repeats 3 (mid twice).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_determinism.py tests/test_planner_smoke.py 2>&1 | tail -2
for i in 1 2; do for det in false true; do
  timeout 120 gem train --device cuda --max-steps 200 --quiet --name det${det}_$i \
    --set attention.impl=jfa --set precision.impl=bf16 --set run.deterministic=$det \
    --set model.hidden=512 --set model.num_blocks=4 --set model.num_heads=4 > /tmp/train.log 2>&1
  echo -n "deterministic=$det run $i rc=$? "
  python3 scripts/run_summary.py runs/det${det}_$i || tail -5 /tmp/train.log
done; done
export PREDICT_TIMEOUT=150
for i in 2 3; do
  scripts/predict_on_gpu.sh mid_r$i --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 --repeats 3 2>&1 | grep -E "==|repeats"
done
scripts/predict_on_gpu.sh large_r2 --hidden 1024 --blocks 8 --max-len 2048 --batch 64 --steps 6 --repeats 3 2>&1 | grep -E "==|repeats"
