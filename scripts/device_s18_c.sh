#!/usr/bin/env bash
# Session 18, third call: the forward's activation arithmetic (scale folded into one fma; silu as
# h + h·tanh h) against the previous (fwd_A), the Gluon GPU tests, gem bench attention on every
# workload, and GemModel training on the Gluon kernels.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 90 python3 scripts/gluon_variants.py --part fwd --budget-s 80 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/variants.txt"
echo "variants rc=$?"; cat "$OUT/variants.txt"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests.txt" | head -20; tail -1 "$OUT/tests.txt"
for w in dense95 heavytail; do
  for a in softmax silu; do
    timeout 55 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
    echo "== $a $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
  done
done
timeout 75 python3 scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/train_check.txt"; tail -6 "$OUT/train_check.txt"
