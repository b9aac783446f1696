#!/usr/bin/env bash
# Session 13 GPU run 2: the jagged attention tests on the GPU, then the attention benchmark with
# the compact tile schedule (the tree then) and without it (ab_old: `git archive HEAD` unpacked
# beside it before the run), same machine. The schedule was measured no faster and reverted, so
# re-running this now compares two equal trees (make ab_old from the commit to compare against).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() {  # $1 = label
  for w in dense95 heavytail; do
    timeout 100 gem bench attention --workload $w --anchors varlen > "$OUT/attn_$1_$w.txt" 2>&1
    echo "== $1 $w rc=$?"; grep -E "^gemcore|^varlen" "$OUT/attn_$1_$w.txt" | cut -c1-120
  done
  timeout 100 gem bench attention --workload cross --pma 16 --anchors varlen > "$OUT/attn_$1_cross.txt" 2>&1
  echo "== $1 cross rc=$?"; grep -E "^gemcore|^varlen" "$OUT/attn_$1_cross.txt" | cut -c1-120
}
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
bench new
(cd ab_old && python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip2.log 2>&1) || { cat /tmp/pip2.log; exit 1; }
(cd ab_old && bench old)
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1
bench new2
timeout 260 python3 -m pytest -q -p no:warnings tests/test_jagged_attention_triton.py > "$OUT/gpu_attn_tests.log" 2>&1
echo "GPU attention tests rc=$?"; tail -3 "$OUT/gpu_attn_tests.log"
