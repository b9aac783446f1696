#!/usr/bin/env bash
# Session 16, last call: the Gluon forward's GPU tests with the adopted tiles, then gem bench
# attention on dense95 / heavytail (softmax, silu) and cross (gelu_tanh, PMA), GPU time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -3
for w in dense95 heavytail; do
  for a in softmax silu; do
    timeout 100 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
    echo "== $a $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
  done
done
timeout 100 gem bench attention --workload cross --gpu-time --anchors varlen --pma 16 > "$OUT/bench_cross.txt" 2>&1
echo "== cross rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_cross.txt"
