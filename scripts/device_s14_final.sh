#!/usr/bin/env bash
# Session 14 final GPU run: the attention GPU tests (eager Function + custom-op paths, compile,
# selective AC), host time per call, then gem bench attention per call and --gpu-time.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
timeout 200 python3 -m pytest -q -p no:warnings $XDIST tests/test_jagged_attention_triton.py tests/test_jagged_attention.py \
  tests/test_activation_checkpointing.py > "$OUT/gpu_tests.log" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -8
timeout 60 python3 scripts/attn_host_overhead.py 2>&1 | tee "$OUT/host.txt"
for w in dense95 heavytail; do
  for mode in "" "--gpu-time"; do
    timeout 100 gem bench attention --workload $w --anchors sdpa,varlen $mode > "$OUT/attn_${w}${mode}.txt" 2>&1
    echo "== $w $mode rc=$?"; grep -v "^\s*$" "$OUT/attn_${w}${mode}.txt" | cut -c1-130 | tail -6
  done
done
timeout 100 gem bench attention --workload cross --pma 16 --anchors varlen --gpu-time > "$OUT/attn_cross.txt" 2>&1
echo "== cross --gpu-time rc=$?"; grep -v "^\s*$" "$OUT/attn_cross.txt" | cut -c1-130 | tail -4
