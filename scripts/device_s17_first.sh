#!/usr/bin/env bash
# For the next session's first device call: the Gluon dK/dV prototype
# (scripts/gluon_attn_bwd_prototype.py) on the GPU: parity against float64 autograd for softmax
# and silu, then its GPU time on dense95 / heavytail (2 and 3 ring slots) beside gemcore's whole
# Triton backward in the same process; then the MX GEMM prototype. Timeouts sum under the
# 600 s per-call limit.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
# the Gluon forward's GPU tests on the final code (the hypothesis lengths test is new, not yet run)
timeout 180 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -3
cd scripts && timeout 220 python3 gluon_attn_bwd_prototype.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -30
# then the Gluon MX GEMM prototype (issue 4): parity per variant (relative error <= 1e-4 against
# the float64 product), then TFLOP/s beside cuBLAS bf16, torch._scaled_mm FP8 and gemcore's mx_matmul
timeout 160 python3 gluon_mx_gemm_prototype.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -20
