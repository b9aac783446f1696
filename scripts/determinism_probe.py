"""Which op makes a bf16 `gem train` on the GPU differ between identical runs?

Runs the same short `gem train` (jfa + bf16, hidden 512 x 4 blocks) twice as it is, then twice
under ``torch.use_deterministic_algorithms(True, warn_only=True)`` with cuBLAS's deterministic
workspace, and prints whether each pair's losses agree bit for bit and the ops PyTorch names as
nondeterministic (its warnings). One process, CUDA only.

    python scripts/determinism_probe.py --steps 60
"""
from __future__ import annotations

import argparse
import json
import os
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # before CUDA starts


def losses(run_dir: str) -> list[float]:
    """Every logged training loss of run ``run_dir`` (metrics.jsonl), in step order."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [row["loss"] for row in map(json.loads, f) if "loss" in row]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="jfa")
    args = ap.parse_args()
    import torch

    from gemcore.cli.main import main as gem

    def train(name: str) -> list[float]:
        code = gem(["train", "--device", args.device, "--max-steps", str(args.steps), "--quiet", "--name", name,
                    "--set", f"attention.impl={args.attention}", "--set", "precision.impl=bf16", "--set", "model.hidden=512",
                    "--set", "model.num_blocks=4", "--set", "model.num_heads=4"])
        assert code == 0, f"gem train {name}: exit code {code}"
        return losses(os.path.join("runs", name))

    plain = [train(f"plain{i}") for i in (1, 2)]
    torch.use_deterministic_algorithms(True, warn_only=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strict = [train(f"deterministic{i}") for i in (1, 2)]
    torch.use_deterministic_algorithms(False)
    named = sorted({str(w.message).split("\n")[0][:200] for w in caught if "determinis" in str(w.message)})
    for label, (a, b) in (("as is", plain), ("deterministic algorithms", strict)):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        print(f"{label}: {len(a)} losses, bitwise equal: {a == b}, first difference at logged step {first}, "
              f"last {a[-1]!r} vs {b[-1]!r}")
    print("ops PyTorch names as nondeterministic:", named or "none")


if __name__ == "__main__":
    main()
