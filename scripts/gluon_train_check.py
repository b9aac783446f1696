"""Device check: GemModel trains on the GPU with the Triton backend, once with the Hopper (Gluon)
forward and once without (GEMCORE_GLUON_ATTENTION=0), same seeds and batches; prints both runs'
losses (the planner smoke's JSON line) and how many attention calls took the Gluon forward.

    python scripts/gluon_train_check.py --hidden 512 --blocks 2 --max-len 2048 --batch 16 --steps 4
"""
from __future__ import annotations

import os
import sys

from gemcore.kernels import jagged_attention_gluon
from gemcore.planner import smoke


def main(argv: list[str]) -> int:
    calls = [0]
    real = jagged_attention_gluon.jagged_attention_fwd_hopper

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    jagged_attention_gluon.jagged_attention_fwd_hopper = counted
    for switch in ("1", "0"):
        os.environ["GEMCORE_GLUON_ATTENTION"] = switch
        calls[0] = 0
        print(f"GEMCORE_GLUON_ATTENTION={switch}:", flush=True)
        rc = smoke.main(["--device", "cuda", *argv])
        print(f"  attention forwards on the Gluon kernel: {calls[0]}", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
