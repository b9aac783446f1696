#!/usr/bin/env bash
# Session 16: the Gluon forward's gradient test, then its tile / ring sweep (GPU time).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -4
cd scripts && timeout 300 python3 gluon_fwd_sweep.py --budget-s 280 2>&1 | grep -vE "leaked|nanobind|^ - "
