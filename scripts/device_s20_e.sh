set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " > "$OUT/tests_bwd.txt"; grep -E "passed|failed|^E " "$OUT/tests_bwd.txt" | head
cd scripts && timeout 150 python3 gluon_variants.py --part fwd --workloads dense95 heavytail --activations softmax --budget-s 120 2>&1 | grep -vE "leaked|nanobind|^ - "
