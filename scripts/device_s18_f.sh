#!/usr/bin/env bash
# Session 18, last extra call: the forward with ping-pong turns between its two consumer
# warpgroups (fwd_B, the working tree) against without (fwd_A); if B is faster on dense95
# softmax, the forward's GPU tests on it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 60 python3 scripts/gluon_variants.py --part fwd --workloads dense95 heavytail --activations softmax silu --budget-s 45 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/variants.txt"
echo "variants rc=$?"; cat "$OUT/variants.txt"
if python3 - "$OUT/variants.txt" <<'PY'
import re, sys
ms = {m.group(1): float(m.group(2)) for m in re.finditer(r"dense95 softmax fwd (fwd_\w): .*?\(([\d.]+) ms\)", open(sys.argv[1]).read())}
print("dense95 softmax ms:", ms)
sys.exit(0 if ms.get("fwd_B", 1e9) < ms.get("fwd_A", 0) else 1)
PY
then
  timeout 130 python3 -m pytest -q -p no:cacheprovider -x tests/test_jagged_attention_gluon.py 2>&1 \
    | grep -vE "leaked|nanobind|^ - " > "$OUT/tests.txt"; grep -E "passed|failed|Error|^E " "$OUT/tests.txt" | head -20; tail -1 "$OUT/tests.txt"
fi
