#!/usr/bin/env bash
# Session 24, GPU call 1: (1) the host-bound small planner row as four run+calibration pairs in one
# process (scripts/small_row_pairs.py), then alternately in processes pinned to one CPU and not;
# (2) which op makes the bf16 GPU `gem train` differ between identical runs
# (scripts/determinism_probe.py).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
nproc; grep -m1 "model name" /proc/cpuinfo; uptime
SMALL="--device cuda --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20"
timeout 200 python3 scripts/small_row_pairs.py --pairs 4 -- $SMALL 2> "$OUT/pairs.err" | tee "$OUT/pairs.txt" || tail -5 "$OUT/pairs.err"
for i in 1 2; do
  for pin in "taskset -c 3" ""; do
    echo "-- process $i ${pin:-unpinned}"
    timeout 100 $pin python3 scripts/small_row_pairs.py --pairs 1 -- $SMALL 2>> "$OUT/pairs.err" | tee -a "$OUT/pairs.txt"
  done
done
timeout 200 python3 scripts/determinism_probe.py --steps 60 > "$OUT/determinism.txt" 2>&1
echo "determinism rc=$?"; grep -E "^as is|^deterministic|^ops|Error" "$OUT/determinism.txt"
