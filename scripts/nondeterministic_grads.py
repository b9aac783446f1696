"""Which parameters' gradients differ between two identical backward passes of `gem train`'s step?

Builds the run exactly as `gem train --device cuda` does (a Trainer from the config: jfa
attention, bf16 autocast over float32 master weights, hidden 512 x 4 blocks x 4 heads), takes its
first ``--batches`` batches from its own loader, and for each computes the gradients twice from the
same weights. Three modes: PyTorch's deterministic algorithms off; on with uninitialized memory
left as it is; on with it filled (PyTorch's default when on: NaN in every new float tensor, so a
read of memory nothing wrote shows). Prints, per mode, the parameters whose gradients were not
bitwise equal and in how many batches.

    python scripts/nondeterministic_grads.py --batches 40
"""
from __future__ import annotations

import argparse
import os
import tempfile

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--attention", default="jfa")
    args = ap.parse_args()
    import torch
    import torch.utils.deterministic

    from gemcore.config import load_config
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import Trainer

    config = load_config(None, [f"run.device='{args.device}'", f"attention.impl='{args.attention}'",
                                "precision.impl='bf16'", "model.hidden=512", "model.num_blocks=4",
                                "model.num_heads=4"])
    trainer = Trainer(config, create_plugin_manager(), tempfile.mkdtemp())
    loader = torch.utils.data.DataLoader(trainer.train_data, batch_sampler=trainer.sampler,
                                         collate_fn=lambda b: b)
    batches = [b.to(trainer.device) for _, b in zip(range(args.batches), loader)]
    model, precision = trainer.model, trainer.parts.precision

    def grads(batch) -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        with precision.autocast(trainer.device.type):
            loss = model.loss(batch)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    for deterministic, fill in ((False, False), (True, False), (True, True)):
        torch.use_deterministic_algorithms(deterministic)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        differ: dict[str, int] = {}
        for batch in batches:
            first, second = grads(batch), grads(batch)
            for name in first:
                if not torch.equal(first[name], second[name]):
                    differ[name] = differ.get(name, 0) + 1
        print(f"deterministic {'on' if deterministic else 'off'}, fill {'on' if fill else 'off'}: parameters "
              f"whose gradients differed (of {len(batches)} batches): {differ or 'none'}", flush=True)


if __name__ == "__main__":
    main()
