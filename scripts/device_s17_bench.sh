#!/usr/bin/env bash
# Session 17: gem bench attention with the Gluon backward: rows (gluon fwd, gluon bwd), (gluon fwd,
# triton bwd), (triton fwd, triton bwd) and varlen_attn in the same process, GPU time.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for w in dense95 heavytail; do
  for a in softmax silu; do
    timeout 130 gem bench attention --workload $w --activation $a --gpu-time --anchors varlen > "$OUT/bench_${a}_$w.txt" 2>&1
    echo "== $a $w rc=$?"; grep -E "gemcore|varlen|Error" "$OUT/bench_${a}_$w.txt"
  done
done
