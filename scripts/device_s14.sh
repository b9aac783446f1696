#!/usr/bin/env bash
# Session 14 GPU run: lazy-rescale A/B of the softmax forward, the GPU-only tests, then the
# attention benchmark with its anchors in the same run.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 scripts/attn_lazy_rescale_ab.py 150 2>&1 | tee "$OUT/lazy_ab.txt" | grep -v "^\s*$" | cut -c1-150
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
timeout 200 python3 -m pytest -q -p no:warnings $XDIST tests/test_jagged_attention_triton.py \
  tests/test_activation_checkpointing.py > "$OUT/gpu_tests.log" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
for w in dense95 heavytail; do
  timeout 90 gem bench attention --workload $w --anchors sdpa,varlen > "$OUT/attn_$w.txt" 2>&1
  echo "== $w rc=$?"; grep -v "^\s*$" "$OUT/attn_$w.txt" | cut -c1-160 | tail -8
done
