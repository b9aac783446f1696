#!/usr/bin/env bash
# Session 15, last call: GPU parity of the pointwise dK/dV tile at real sizes, then silu heavytail
# and dense95 with it (GPU time, varlen_attn beside).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 60 python3 -m pytest -q -x -p no:cacheprovider tests/test_jagged_attention_triton.py -k "bf16_real_sizes and (silu or gelu_tanh)" 2>&1 | tail -3
for w in heavytail dense95; do
  timeout 40 gem bench attention --workload $w --activation silu --gpu-time --anchors varlen 2>&1 | grep -E "gemcore|varlen"
done
