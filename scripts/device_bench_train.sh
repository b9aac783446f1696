#!/usr/bin/env bash
# Issue 8 on one GPU: gem bench train for heavytail and dense95 (run by the lead through the device tool).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
timeout 330 gem bench train --device cuda --workload heavytail --users 48 --steps 10 --warmup 3 \
    --configs padded,bf16,mxfp8,bf16+compile --json > "$OUT/heavytail.json" 2> "$OUT/heavytail.err"
echo "heavytail rc=$?"; tail -3 "$OUT/heavytail.err"
python3 -c "import json,sys; d=json.load(open('$OUT/heavytail.json')); [print(r['config'], round(r['tokens_per_s']), r['mfu'], round(r['step_ms'],1), round(r['peak_mem_gb'],1), r['heldout_loss'], r['speedup_vs_padded'], r['syncs_per_step'], r['error'][:120]) for r in d['results']]; [print(x) for x in d['local_mfu']]"
timeout 200 gem bench train --device cuda --workload dense95 --users 64 --steps 8 --warmup 2 \
    --configs padded,bf16,mxfp8 --no-local-mfu --json > "$OUT/dense95.json" 2> "$OUT/dense95.err"
echo "dense95 rc=$?"; tail -3 "$OUT/dense95.err"
python3 -c "import json,sys; d=json.load(open('$OUT/dense95.json')); [print(r['config'], round(r['tokens_per_s']), r['mfu'], round(r['step_ms'],1), round(r['peak_mem_gb'],1), r['heldout_loss'], r['speedup_vs_padded'], r['syncs_per_step'], r['error'][:120]) for r in d['results']]"
