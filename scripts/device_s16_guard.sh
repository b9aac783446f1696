#!/usr/bin/env bash
# Session 16: the targets-only mask and -inf guard as constexpr branches: targets and softmax
# parity on the GPU, then the softmax dense95 row.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_jagged_attention_gluon.py -k "targets or (softmax and True and dtype0) or gradients" 2>&1 | grep -E "passed|failed|Error" | tail -3
timeout 60 gem bench attention --workload dense95 --activation softmax --gpu-time --anchors varlen 2>&1 | grep -E "gemcore|varlen|Error"
