#!/usr/bin/env bash
# Session 16: the warp-specialized Gluon forward (scripts/gluon_attn_fwd_ws_prototype.py), one
# process per variant so a hang costs one timeout, not the call.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
cd scripts
for variant in ${VARIANTS:-ws_n128s2 ws_n64s4 ws_n128s3}; do
  timeout 120 python3 gluon_attn_fwd_ws_prototype.py --variant "$variant" 2>&1 | grep -v "^ *$" | tail -12
  echo "[$variant rc=${PIPESTATUS[0]}]"
done
