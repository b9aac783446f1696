"""Device check: GemModel trains on the GPU with the Triton backend, once with the Hopper (Gluon)
forward and backward and once without (GEMCORE_GLUON_ATTENTION=0), same seeds and batches; prints
both runs' losses (the planner smoke's JSON line) and how many attention calls took the Gluon
kernels.

    python scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4
"""
from __future__ import annotations

import os
import sys

from gemcore.kernels import jagged_attention_gluon, jagged_attention_gluon_bwd
from gemcore.planner import smoke


def _counted(module, name: str, calls: dict) -> None:
    """Replace module.name by a wrapper that counts its calls in calls[name]."""
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[name] += 1
        return real(*args, **kwargs)

    setattr(module, name, counted)


def main(argv: list[str]) -> int:
    calls = {"jagged_attention_fwd_hopper": 0, "jagged_attention_bwd_hopper": 0}
    _counted(jagged_attention_gluon, "jagged_attention_fwd_hopper", calls)
    _counted(jagged_attention_gluon_bwd, "jagged_attention_bwd_hopper", calls)
    for switch in ("1", "0"):
        os.environ["GEMCORE_GLUON_ATTENTION"] = switch
        calls.update(dict.fromkeys(calls, 0))
        print(f"GEMCORE_GLUON_ATTENTION={switch}:", flush=True)
        rc = smoke.main(["--device", "cuda", *argv])
        print(f"  attention calls on the Gluon kernels: forward {calls['jagged_attention_fwd_hopper']}, "
              f"backward {calls['jagged_attention_bwd_hopper']}", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
