#!/usr/bin/env bash
# Final GPU checks: attention parity, comms gpu_check, issue-8 heavytail with the current kernels.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 110 python3 -m pytest -q -x -p no:warnings tests/test_jagged_attention_triton.py > "$OUT/attn_tests.log" 2>&1
echo "attention GPU tests rc=$?"; tail -3 "$OUT/attn_tests.log"
timeout 170 python3 -m gemcore.comms.gpu_check > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?"; grep -E "^==|OK|FAIL|slowdown|goal|Error" "$OUT/gpu_check.log" | head -40
timeout 140 gem bench train --device cuda --workload heavytail --users 48 --steps 10 --warmup 3 \
    --configs padded,bf16,bf16+compile --json > "$OUT/heavytail2.json" 2> "$OUT/heavytail2.err"
echo "heavytail rc=$?"; tail -2 "$OUT/heavytail2.err"
python3 -c "import json; d=json.load(open('$OUT/heavytail2.json')); [print(r['config'], round(r['tokens_per_s']), r['mfu'], round(r['step_ms'],1), round(r['peak_mem_gb'],1), r['heldout_loss'], r['speedup_vs_padded'], r['syncs_per_step'], r['error'][:120]) for r in d['results']]; [print(x) for x in d['local_mfu']]"
