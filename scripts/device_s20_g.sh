#!/usr/bin/env bash
# Session 20: the host-bound planner row's timeline (scripts/step_timeline.py), the three sizes of the predicted-vs-measured table (per-phase host and GPU borders, then a profile).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /tmp/pip.log 2>&1 || { cat /tmp/pip.log; exit 1; }
timeout 120 python3 scripts/step_timeline.py --hidden 512 --blocks 4 --max-len 512 --batch 16 2>&1 | grep -vE "Warning|warn|detach|float.loss"
timeout 120 python3 scripts/step_timeline.py --hidden 768 --blocks 6 --max-len 1024 --batch 32 2>&1 | grep -vE "Warning|warn|detach|float.loss"
timeout 120 python3 scripts/step_timeline.py --hidden 1024 --blocks 8 --max-len 2048 --batch 64 2>&1 | grep -vE "Warning|warn|detach|float.loss"
