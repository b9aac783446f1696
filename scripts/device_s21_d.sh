#!/usr/bin/env bash
# Session 21, on the cached work lists (the code of this session's first call): the official rows of
# every anchor workload (dense95 / heavytail x softmax / silu, cross with PMA Nq=16), each with
# varlen_attn in the same process; then the attention's host time per call at the small model's
# shape (B=16, lengths 256..512) with the Gluon path on and off, and where that time goes.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader
for wa in "dense95 softmax" "dense95 silu" "heavytail softmax" "heavytail silu"; do set -- $wa
  timeout 60 gem bench attention --workload $1 --activation $2 --gpu-time --anchors varlen > "$OUT/bench_$2_$1.txt" 2>&1
  grep -E "workload|gemcore|varlen|Error" "$OUT/bench_$2_$1.txt"
done
timeout 90 gem bench attention --workload cross --gpu-time --anchors varlen --pma 16 > "$OUT/bench_cross.txt" 2>&1
grep -E "workload|gemcore|varlen|Error" "$OUT/bench_cross.txt"
timeout 60 python3 scripts/attn_host_overhead.py --batch 16 --max-len 512 --profile 2>&1 | grep -vE "Warning|warn" > "$OUT/host.txt"
head -5 "$OUT/host.txt"; sed -n '/tottime/,$p' "$OUT/host.txt" | head -26 | cut -c1-160
GEMCORE_GLUON_ATTENTION=0 timeout 60 python3 scripts/attn_host_overhead.py --batch 16 --max-len 512 2>&1 | grep -vE "Warning|warn" | head -4
