#!/usr/bin/env bash
# Session 15, call 1: planner predicted vs measured step time on one GPU; TorchTitan-style Llama 3 8B
# memory probe (peak allocated / reserved per layer count beside the planner's prediction).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv
timeout 120 python3 scripts/llama_memory_probe.py --layers 2 4 8 > "$OUT/memprobe.txt" 2> "$OUT/memprobe.err"
echo "memprobe rc=$?"; grep -v '^{' "$OUT/memprobe.txt"; tail -5 "$OUT/memprobe.err"
bash scripts/device_s14_predict.sh
