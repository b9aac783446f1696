#!/usr/bin/env bash
# Session 25, GPU call 5, final code: the planner's test files on the GPU (8 pytest-xdist workers,
# xdist from the carried wheels in .whl/).
set -u
export PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
python3 -c "import xdist" 2>/dev/null || python3 -m pip install -q --no-index --find-links .whl pytest-xdist > /tmp/pipx.log 2>&1 || tail -3 /tmp/pipx.log
timeout -s INT 300 python3 -m pytest -q -p no:cacheprovider -n 8 -rs tests/test_planner_*.py 2>&1 | grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" | tail -12
