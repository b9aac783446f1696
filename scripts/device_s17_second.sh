#!/usr/bin/env bash
# For the next session's second device call: the Gluon dQ prototype
# (scripts/gluon_attn_bwd_dq_prototype.py): parity of dq and delta against float64 autograd for
# softmax and silu, then its GPU time on dense95 / heavytail beside gemcore's whole Triton backward.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
cd scripts && timeout 300 python3 gluon_attn_bwd_dq_prototype.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -20
