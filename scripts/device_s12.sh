#!/usr/bin/env bash
# Session 12 GPU checks: MX cast kernels (hardware rounding, unmasked tiles) on the GPU, the new
# distributed code paths (MX FSDP2 all-gather, pipeline and expert parallelism) on the device's torch.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:warnings tests/test_mx_triton.py > "$OUT/mx_triton_tests.log" 2>&1
echo "mx triton GPU tests rc=$?"; tail -3 "$OUT/mx_triton_tests.log"
timeout 200 gem bench mx --sweep --skip gemm,shapes > "$OUT/bench_mx.txt" 2>&1
echo "bench mx rc=$?"; cat "$OUT/bench_mx.txt" | grep -v "^\s*$" | cut -c1-140 | head -60
if [ "${DIST:-0}" = 1 ]; then
export CUDA_VISIBLE_DEVICES=  # the distributed tests below are the CPU/gloo ones, on this image's torch
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
timeout 200 python3 -m pytest -q -p no:warnings tests/test_expert_parallel_comms.py > "$OUT/dist_tests.log" 2>&1
echo "dist tests rc=$?"; tail -15 "$OUT/dist_tests.log"
fi
