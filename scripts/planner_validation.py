"""Predicted against published tokens/s per GPU for the runs docs/planner.md validates the cost
model against (sources and assumptions there): each run's published layout through
``gem plan --degrees``; the power-capped H100 rows at both clock laws (α = 1/3, the default, and
α = 1). The published figures are data from those sources, not results of this repository.

    python scripts/planner_validation.py
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

GRAND_TETON = Path(__file__).resolve().parents[1] / "docs" / "planner" / "grand-teton-h100-500w.toml"
META = ["--gpu", "h100", "--kernels", "fused"]
TT_H100 = ["--cluster", str(GRAND_TETON)]
#: (run, published tokens/s/GPU, gem plan arguments, power-capped)
RUNS = [
    ("Meta 405B, 8,192 H100", 168, ["--model", "llama3-405b", "--gpus", "8192", "--seq-len", "8192",
                                     "--global-batch", "2048", *META, "--degrees",
                                     "tp=8,pp=16,dp_shard=64,ac=selective,v=4,reshard=false"], False),
    ("Meta 405B, 16,384 H100", 161, ["--model", "llama3-405b", "--gpus", "16384", "--seq-len", "8192",
                                      "--global-batch", "2048", *META, "--degrees",
                                      "tp=8,pp=16,dp_shard=128,ac=selective,v=4,reshard=false"], False),
    ("Meta 405B, 16,384 H100, 128K", 93, ["--model", "llama3-405b", "--gpus", "16384", "--seq-len", "131072",
                                           "--global-batch", "128", *META, "--degrees",
                                           "tp=8,cp=16,pp=16,dp_shard=8,ac=selective,v=4,reshard=false"], False),
    ("TorchTitan 8B, 64 A100", 2973, ["--model", "llama3-8b", "--gpu", "a100", "--gpus", "64", "--seq-len", "8192",
                                       "--global-batch", "64", "--kernels", "eager", "--degrees",
                                       "dp_shard=64,ac=selective,sac=every_other_mm"], False),
    ("TorchTitan 70B, 64 A100", 331, ["--model", "llama3-70b", "--gpu", "a100", "--gpus", "64", "--seq-len", "8192",
                                       "--global-batch", "64", "--kernels", "eager", "--degrees",
                                       "dp_shard=64,ac=full"], False),
    ("TorchTitan 8B, 8 H100, FSDP", 5762, ["--model", "llama3-8b", *TT_H100, "--gpus", "8", "--seq-len", "8192",
                                            "--global-batch", "16", "--kernels", "eager", "--degrees",
                                            "dp_shard=8,mbs=2,ac=selective,sac=every_other_mm"], True),
    ("TorchTitan 8B, 128 H100, FSDP", 5605, ["--model", "llama3-8b", *TT_H100, "--gpus", "128", "--seq-len",
                                              "8192", "--global-batch", "256", "--kernels", "eager", "--degrees",
                                              "dp_shard=128,mbs=2,ac=selective,sac=every_other_mm"], True),
    ("TorchTitan 8B, 8 H100, + compile", 6667, ["--model", "llama3-8b", *TT_H100, "--gpus", "8", "--seq-len",
                                                 "8192", "--global-batch", "16", "--kernels", "compiled-blocks",
                                                 "--degrees", "dp_shard=8,mbs=2,ac=selective,sac=every_other_mm"],
     True),
    ("TorchTitan 8B, 128 H100, + compile", 6514, ["--model", "llama3-8b", *TT_H100, "--gpus", "128", "--seq-len",
                                                   "8192", "--global-batch", "256", "--kernels", "compiled-blocks",
                                                   "--degrees", "dp_shard=128,mbs=2,ac=selective,sac=every_other_mm"],
     True),
]


def predicted(args: list[str]) -> dict:
    """The one plan ``gem plan --degrees ... --json`` returns (exit code 2 with the plan, when
    it does not fit the planner's memory headroom, as the 8,192-GPU 405B layout)."""
    done = subprocess.run([sys.executable, "-m", "gemcore.cli.main", "plan", *args, "--json"],
                          capture_output=True, text=True)
    try:
        out = json.loads(done.stdout)
        return out["plans"][0] if out["plans"] else out["estimate"]
    except (json.JSONDecodeError, KeyError, IndexError):
        raise SystemExit(f"gem plan {' '.join(args)}: exit {done.returncode}\n{done.stdout}{done.stderr}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        alpha_one = Path(tmp) / "alpha1.toml"
        alpha_one.write_text(GRAND_TETON.read_text() + "power_clock_exponent = 1.0\n")
        print(f"{'run':38s} {'published':>9s} {'α=1/3':>14s} {'α=1':>14s}  exposed comm (s), α=1/3")
        for name, published, args, capped in RUNS:
            plan = predicted(args)
            got = plan["tokens_per_s_per_gpu"]
            row = f"{name:38s} {published:9,d} {got:8,.0f} ({got / published - 1:+4.0%})"
            if capped:
                one = predicted([str(alpha_one) if a == str(GRAND_TETON) else a for a in args])
                row += f" {one['tokens_per_s_per_gpu']:8,.0f} ({one['tokens_per_s_per_gpu'] / published - 1:+4.0%})"
            else:
                row += " " * 15
            comm = {k: round(v, 3) for k, v in plan["exposed_comm_s"].items()}
            print(f"{row}  {comm}", flush=True)


if __name__ == "__main__":
    main()
