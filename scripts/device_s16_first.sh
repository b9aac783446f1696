#!/usr/bin/env bash
# For the next session's first device call: (1) GPU parity of session 15's pointwise dK/dV tile at
# real sizes, (2) the Gluon prototype (scripts/gluon_attn_fwd_prototype.py): parity per activation
# and key tile, then dense95 / heavytail forward GPU time beside gemcore's Triton kernel.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_jagged_attention_triton.py -k "bf16_real_sizes" 2>&1 | tail -3
timeout 300 python3 scripts/gluon_attn_fwd_prototype.py 2>&1 | tail -20
