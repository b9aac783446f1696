#!/usr/bin/env bash
# Session 19, fifth GPU call: with the first-warpgroup trim, do 64-key softmax tiles (the trim
# then skips a whole tile) beat 128-key ones? Forward variants, softmax only, same process;
# then the dense95 silu and cross official rows on the final code.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 110 python3 scripts/gluon_variants.py --part fwd --activations softmax --budget-s 95 2>&1 | grep -vE "leaked|nanobind|^ - " | tee "$OUT/variants_fwd_tiles.txt"
timeout 45 gem bench attention --workload dense95 --activation silu --gpu-time --anchors varlen > "$OUT/bench_silu_dense95.txt" 2>&1
grep -E "gemcore|varlen|Error" "$OUT/bench_silu_dense95.txt"
timeout 50 gem bench attention --workload cross --gpu-time --anchors varlen > "$OUT/bench_cross.txt" 2>&1
grep -E "gemcore|varlen|Error" "$OUT/bench_cross.txt"
