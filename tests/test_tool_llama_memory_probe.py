"""tools/llama_memory_probe.py on CPU at toy sizes: TorchTitan's every-other-mm checkpointing
policy recomputes exactly the even-numbered matmuls and leaves the gradients unchanged, and the
planner's prediction the tool prints grows with the layer count. (The measurement itself needs
a GPU: `python tools/llama_memory_probe.py`.)"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

PATH = Path(__file__).resolve().parents[1] / "tools" / "llama_memory_probe.py"


def _tool():
    spec = importlib.util.spec_from_file_location("llama_memory_probe", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module            # dataclasses look their module up while it loads
    spec.loader.exec_module(module)
    return module


class _CountMM(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.mm.default:
            self.mm += 1
        return func(*args, **(kwargs or {}))


def _step(tool, sac: bool, layers: int = 2):
    """Loss and parameter gradients of one forward+backward of a toy Llama, and the aten.mm calls
    of the backward alone."""
    torch.manual_seed(0)
    shape = tool.LlamaShape(layers=layers, hidden=32, heads=4, kv_heads=2, ffn=64, vocab=50)
    model = tool.Llama(shape, sac=sac).double()
    ids = torch.randint(0, shape.vocab, (2, 9))
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten(0, 1))
    with _CountMM() as count:
        loss.backward()
    return float(loss.detach()), [p.grad.clone() for p in model.parameters()], count.mm


def test_every_other_mm_policy_recomputes_three_matmuls_per_block_and_keeps_the_gradients():
    tool = _tool()
    loss, grads, mm = _step(tool, sac=False)
    loss_sac, grads_sac, mm_sac = _step(tool, sac=True)
    assert loss_sac == loss
    for g, g_sac in zip(grads, grads_sac):
        torch.testing.assert_close(g_sac, g, rtol=0, atol=0)
    # the block's mm calls in forward order: wq wk wv wo w1 w3 w2; the even-numbered ones (wk, wo,
    # w3) run again in the backward, 2 blocks
    assert mm_sac - mm == 3 * 2


def test_the_prediction_grows_with_the_layers():
    tool = _tool()
    small, large = tool.predicted(2, 2, 8192, "eager"), tool.predicted(8, 2, 8192, "eager")
    assert 0 < small["peak"] < large["peak"]
    assert large["activations"] > small["activations"]
