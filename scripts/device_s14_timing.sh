#!/usr/bin/env bash
# Session 14: host time per attention call, then gem bench attention timed per call from an idle
# GPU (host work included) and with --gpu-time (GPU alone), anchors in the same runs.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 60 python3 scripts/attn_host_overhead.py 2>&1 | tee "$OUT/host.txt"
for w in dense95 heavytail; do
  for mode in "" "--gpu-time"; do
    timeout 100 gem bench attention --workload $w --anchors sdpa,varlen $mode > "$OUT/attn_${w}${mode}.txt" 2>&1
    echo "== $w $mode rc=$?"; grep -v "^\s*$" "$OUT/attn_${w}${mode}.txt" | cut -c1-130 | tail -6
  done
done
