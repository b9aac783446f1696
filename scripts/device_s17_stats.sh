#!/usr/bin/env bash
# Session 17: the Gluon backward with softmax's LSE / delta loaded by TMA in the dK/dV kernel (no
# spills): its GPU tests, GemModel training with and without the Gluon kernels, then gem bench
# attention on dense95 / heavytail, GPU time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " | grep -E "passed|failed|Error|^E " | head -20
timeout 150 python3 scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -8
for w in dense95 heavytail; do
  for a in softmax silu; do
    timeout 110 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
    echo "== $a $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
  done
done
# the backward's ring depths, backward alone (scripts/gluon_bwd_sweep.py)
cd scripts && timeout 150 python3 gluon_bwd_sweep.py --budget-s 120 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -30
