#!/usr/bin/env bash
# Session 25, GPU call 4 (final code: FSDP copy rate after a gather): the CPU predicted-vs-measured rows on the device host's CPU cores with the
# GPU hidden (ranks there leave cores spare, unlike the 2-core machine), one rank's collectives
# split into core time and arrival skew; the one-GPU mid and small rows (--repeats 3).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
echo "cores: $(nproc); $(lscpu | grep 'Model name' | sed 's/  */ /g')"
scripts/cpu_predict_rows.sh 1:256:2:256:3 2:256:2:256:3 4:256:2:256:3 2:512:4:512:2
CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 COLLECTIVE_LOG_DIR=/tmp timeout 100 python3 -m torch.distributed.run \
    --nproc-per-node 2 scripts/collective_core_time.py --steps 20 --hidden 256 --blocks 2 --max-len 256 > /dev/null 2>&1
COLLECTIVE_LOG_DIR=/tmp python3 scripts/collective_core_time.py --analyze
export PREDICT_TIMEOUT=150
scripts/predict_on_gpu.sh mid_r --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6 --repeats 3 2>&1 | grep -E "==|repeats"
scripts/predict_on_gpu.sh small_r --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20 --repeats 3 2>&1 | grep -E "==|repeats"
