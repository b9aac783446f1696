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
  python3 scripts/run_summary.py runs/dflt_$impl || tail -5 /tmp/train.log
done
