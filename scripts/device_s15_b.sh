#!/usr/bin/env bash
# Session 15, call 3: loss / rms_norm facts; planner predicted vs measured on one GPU (three sizes,
# eager-torch-rmsnorm stack); Llama 3 8B memory probe with TorchTitan's compiled blocks.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 100 python3 scripts/loss_norm_probe.py > "$OUT/loss_norm.json" 2> "$OUT/loss_norm.err"; echo "loss_norm rc=$?"
python3 -c "
import json; d=json.load(open('$OUT/loss_norm.json')); print(d['eager_loss'], d['compiled_loss'])
k=d['rms_norm_kernels']; print('rms_norm fwd', len(k['forward']), k['forward'][:4]); print('rms_norm bwd', len(k['backward']), k['backward'][:6])" || tail -5 "$OUT/loss_norm.err"
bash scripts/device_s14_predict.sh
scripts/predict_on_gpu.sh mid --hidden 768 --blocks 6 --max-len 1024 --batch 32 --steps 6
timeout 200 python3 scripts/llama_memory_probe.py --layers 2 8 --compile > "$OUT/memprobe_compile.txt" 2> "$OUT/memprobe_compile.err"
echo "memprobe compile rc=$?"; grep -v '^{' "$OUT/memprobe_compile.txt"; tail -5 "$OUT/memprobe_compile.err"
