#!/usr/bin/env bash
# Session 17, third call: the GPU tests of the Gluon forward (targets fix) and the new Gluon
# backward (kernels/jagged_attention_gluon_bwd.py), then the MX GEMM prototype with K-aligned shapes.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 270 python3 -m pytest -q -x -p no:cacheprovider tests/test_jagged_attention_gluon_bwd.py tests/test_jagged_attention_gluon.py 2>&1 \
  | grep -vE "leaked|nanobind|^ - " | grep -E "passed|failed|Error|assert|^E " | head -30
cd scripts && timeout 150 python3 gluon_mx_gemm_prototype.py 2>&1 | grep -vE "leaked|nanobind|^ - " | tail -40
