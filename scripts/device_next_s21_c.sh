#!/usr/bin/env bash
# Prepared at the end of session 20 for a later GPU call: the tl.dot_scaled MX GEMM (backend
# triton_scaled, written with no GPU time left) on the H200, where Triton emulates the block-scaled
# MMA: the MX GPU tests, then its row of `gem bench mx` beside cuBLAS bf16 and the other MX paths.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_mx_triton.py 2>&1 | tail -3
timeout 300 gem bench mx --skip cast,linear 2>&1 | tee "$OUT/bench_mx.txt" | grep -vE "Warning|warn" | tail -30
