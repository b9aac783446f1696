#!/usr/bin/env bash
# Session 23, GPU call 6: every test file that holds GPU tests, on the H200, against the final code
# (stopped with SIGINT after 420 s so pytest still prints its summary).
set -u
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
files=$(grep -l "cuda.is_available\|needs a CUDA\|gpu" tests/test_*.py)
timeout -s INT 420 python3 -m pytest -q -p no:cacheprovider -rs --durations=10 $files 2>&1 | tail -60
