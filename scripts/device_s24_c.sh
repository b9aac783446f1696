#!/usr/bin/env bash
# Session 24, GPU call 3: (1) which gradients differ between identical backward passes of gem
# train's step (scripts/nondeterministic_grads.py, 40 batches, three modes); run.deterministic with
# PyTorch's uninitialized-memory fill off: bitwise equal? tokens/s?; (2) the small planner row
# with --repeats 5 twice more on this machine; (3) every test file holding GPU tests, 8 pytest-xdist
# workers on the one GPU (xdist from the carried wheels in .whl/), stopped with SIGINT at 330 s.
set -u
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist > /tmp/pipx.log 2>&1 || tail -3 /tmp/pipx.log
timeout 120 python3 scripts/nondeterministic_grads.py --batches 40 2>&1 | tail -3
for i in 1 2; do for det in false nofill; do
  set_det=false; [ $det = nofill ] && set_det=true
  timeout 120 python3 -c "
import sys, torch.utils.deterministic as d
d.fill_uninitialized_memory = False
from gemcore.cli.main import main
sys.exit(main(sys.argv[1:]))" train --device cuda --max-steps 200 --quiet --name det${det}_$i \
    --set attention.impl=jfa --set precision.impl=bf16 --set run.deterministic=$set_det \
    --set model.hidden=512 --set model.num_blocks=4 --set model.num_heads=4 > /tmp/train.log 2>&1
  echo -n "deterministic=$det run $i rc=$? "
  python3 scripts/run_summary.py runs/det${det}_$i || tail -5 /tmp/train.log
done; done
export PREDICT_TIMEOUT=150
for i in 4 5; do
  scripts/predict_on_gpu.sh small_r$i --hidden 512 --blocks 4 --max-len 512 --batch 16 --steps 20 --repeats 5 2>&1 | grep -E "==|repeats"
done
files="$(grep -l "cuda.is_available\|needs a CUDA\|gpu" tests/test_*.py) tests/test_planner_smoke.py"
timeout -s INT 330 python3 -m pytest -q -p no:cacheprovider -n 8 -rs $files > "$OUT/gpu_tests.txt" 2>&1
echo "GPU tests rc=$?"; grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" "$OUT/gpu_tests.txt" | tail -15
