#!/usr/bin/env bash
# Session 14 GPU run: A/B of lazy rescaling (forward) and the atomic-dQ backward, then the GPU tests.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 330 python3 scripts/attn_lazy_rescale_ab.py 300 2>&1 | tee "$OUT/ab.txt" | grep -v "^\s*$" | cut -c1-150
XDIST=""; python3 -c "import xdist" 2>/dev/null && XDIST="-n 8"
timeout 220 python3 -m pytest -q -p no:warnings $XDIST tests/test_jagged_attention_triton.py \
  tests/test_activation_checkpointing.py > "$OUT/gpu_tests.log" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gpu_tests.log" | tail -12
