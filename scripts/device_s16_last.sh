#!/usr/bin/env bash
# Session 16, last device call: the Gluon forward's GPU tests (targets, fused-qkv views), GemModel
# training with and without it, then softmax rows of gem bench attention with the final kernel.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -3
timeout 200 python3 scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -8
for w in dense95 heavytail; do
  timeout 90 gem bench attention --workload $w --activation softmax --gpu-time --anchors varlen > "$OUT/bench_softmax_$w.txt" 2>&1
  echo "== softmax $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_softmax_$w.txt"
done
