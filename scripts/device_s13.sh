#!/usr/bin/env bash
# Session 13 GPU run: kernel tests on the GPU, then the attention benchmark on ANCHORS.md's
# workloads (gemcore timed as the model calls it, and with its offset checks), anchors in the same run.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 200 python3 -m pytest -q -p no:warnings tests/test_jagged_attention_triton.py tests/test_mx_triton.py \
  tests/test_mx.py tests/test_comms_ce.py > "$OUT/gpu_tests.log" 2>&1
echo "GPU kernel tests rc=$?"; tail -3 "$OUT/gpu_tests.log"
for w in dense95 heavytail; do
  timeout 150 gem bench attention --workload $w --validated --anchors sdpa,varlen,nested > "$OUT/attn_$w.txt" 2>&1
  echo "== $w rc=$?"; grep -v "^\s*$" "$OUT/attn_$w.txt" | cut -c1-160 | tail -12
done
timeout 120 gem bench attention --workload cross --pma 16 --anchors sdpa,varlen > "$OUT/attn_cross.txt" 2>&1
echo "== cross rc=$?"; grep -v "^\s*$" "$OUT/attn_cross.txt" | cut -c1-160 | tail -10
