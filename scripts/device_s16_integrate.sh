#!/usr/bin/env bash
# Session 16: the Hopper (Gluon) forward inside gemcore: its GPU tests, the Triton parity tests,
# then gem bench attention (GPU time, varlen_attn anchor, the Triton forward beside it).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -8
for w in dense95 heavytail; do
  for a in softmax silu; do
    timeout 120 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
    echo "== $a $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
  done
done
