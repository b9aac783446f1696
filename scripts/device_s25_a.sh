#!/usr/bin/env bash
# Session 25, GPU call 1: the CPU predicted-vs-measured rows on the device host's CPU cores with the
# GPU hidden (ranks there leave cores spare, unlike the 2-core machine), one rank's collectives
# split into core time and arrival skew; then the planner's calibration/smoke tests on the GPU.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
scripts/cpu_predict_rows.sh 1:256:2:256:3 2:256:2:256:3 4:256:2:256:3 2:384:2:256:2 1:512:4:512:2 2:512:4:512:2
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 COLLECTIVE_LOG_DIR=/tmp timeout 100 python3 -m torch.distributed.run \
    --nproc-per-node 2 scripts/collective_core_time.py --steps 20 --hidden 256 --blocks 2 --max-len 256 > /dev/null 2>&1
COLLECTIVE_LOG_DIR=/tmp python3 scripts/collective_core_time.py --analyze
timeout -s INT 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_planner_calibrate.py tests/test_planner_smoke.py 2>&1 | tail -3
