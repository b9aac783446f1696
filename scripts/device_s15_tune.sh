#!/usr/bin/env bash
# Session 15: re-tune the D=128 tiles for the pointwise activations (silu), which changed since the
# last tune (hardware tanh), and softmax on dense95; each run benches the tuned tiles beside the
# anchors in the same process (GPU time). Then the planner's predict runs if time is left.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
for w in dense95 heavytail; do
  timeout 150 gem bench attention --workload $w --activation silu --tune --gpu-time --anchors varlen > "$OUT/tune_silu_$w.txt" 2>&1
  echo "== silu $w rc=$?"; grep -E "best|gemcore|varlen" "$OUT/tune_silu_$w.txt"
done
timeout 150 gem bench attention --workload dense95 --activation softmax --tune --gpu-time --anchors varlen > "$OUT/tune_softmax_dense95.txt" 2>&1
echo "== softmax dense95 rc=$?"; grep -E "best|gemcore|varlen" "$OUT/tune_softmax_dense95.txt"
scripts/predict_on_gpu.sh small --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 8
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
