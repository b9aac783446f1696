"""`train.compile`: each block compiled in place trains as the eager model does, and the
checkpoint keeps the eager model's parameter names (a compiled run resumes an eager one). On CPU the
reference attention breaks the graph (it reads the offsets on the host); on CUDA the jagged
kernels are opaque ops inside it."""
from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow  # about 5 minutes on 2 cores: Inductor builds C++ kernels for the forward, backward and evaluation
def test_compiled_blocks_train_as_eager_ones_and_keep_parameter_names(tmp_path):
    from conftest import TINY

    from gemcore import checkpoint
    from gemcore.config import load_config
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import CHECKPOINT_NAME, run_training

    losses, keys = {}, {}
    for compiled in (False, True):
        config = load_config(None, [*TINY, f"run.out_dir='{tmp_path}'", f"run.name='c{compiled}'", "run.max_steps=3",
                                    "run.log_every=1", f"train.compile={str(compiled).lower()}"])
        _, run_dir = run_training(config, create_plugin_manager())
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        losses[compiled] = [r["loss"] for r in rows if "loss" in r]
        keys[compiled] = sorted(checkpoint.load(run_dir / CHECKPOINT_NAME)["model"])
    assert len(losses[True]) == 3
    torch.testing.assert_close(torch.tensor(losses[True]), torch.tensor(losses[False]), rtol=1e-4, atol=1e-5)
    assert keys[True] == keys[False] and not any("_orig_mod" in k for k in keys[True])
