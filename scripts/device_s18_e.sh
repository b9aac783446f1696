#!/usr/bin/env bash
# Session 18, extra call: dQ with 128-row K/V tiles (2 slots) for softmax (bwd_B, the working
# tree) against 64-row tiles (3 slots, bwd_A); if B is faster on dense95, the Gluon backward's
# softmax GPU tests on it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 80 python3 scripts/gluon_variants.py --part bwd --activations softmax --budget-s 70 2>&1 | grep -vE "leaked|nanobind|^ - " > "$OUT/variants.txt"
echo "variants rc=$?"; cat "$OUT/variants.txt"
if python3 - "$OUT/variants.txt" <<'PY'
import re, sys
ms = {m.group(1): float(m.group(2)) for m in re.finditer(r"dense95 softmax bwd (bwd_\w): .*?\(([\d.]+) ms\)", open(sys.argv[1]).read())}
print("dense95 softmax ms:", ms)
sys.exit(0 if ms.get("bwd_B", 1e9) < ms.get("bwd_A", 0) else 1)
PY
then
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py -k "softmax or hypothesis or backend" 2>&1 \
    | grep -vE "leaked|nanobind|^ - " > "$OUT/tests.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests.txt" | head -20; tail -1 "$OUT/tests.txt"
fi
