#!/usr/bin/env bash
# Session 12 GPU checks: MX cast kernels on the GPU (tests, then the sweep timed as GPU time alone
# and, for the record, with the host's launch included).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:warnings tests/test_mx_triton.py > "$OUT/mx_triton_tests.log" 2>&1
echo "mx triton GPU tests rc=$?"; tail -3 "$OUT/mx_triton_tests.log"
timeout 150 gem bench mx --sweep --skip gemm,shapes,linear > "$OUT/bench_mx.txt" 2>&1
echo "bench mx rc=$?"; cat "$OUT/bench_mx.txt" | grep -v "^\s*$" | cut -c1-150 | head -60
timeout 100 gem bench mx --host-launch --skip gemm,shapes,linear > "$OUT/bench_mx_host.txt" 2>&1
echo "bench mx host-launch rc=$?"; cat "$OUT/bench_mx_host.txt" | grep -v "^\s*$" | cut -c1-150 | head -20
