"""FP8 all-gather of FP8BlockLinear weights under FSDP2 (gemcore.kernels.fp8_block_fsdp).

One process: FSDP2's protocol called by hand, the gathered layer against the plain layer, the
optimizer and state_dict. Two processes: this file run as a script under ``torchrun
--nproc-per-node 2`` with gloo on CPU, a small FP8 model wrapped with ``fully_shard`` against
the same model unsharded in one process: bytes gathered, outputs, gradients, AdamW steps.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gemcore.kernels import fp8_block as fb
from gemcore.kernels.fp8_block_fsdp import (FP8BlockGatheredWeight, FP8BlockShardedWeight,
                                            fp8_block_gather_bytes, wrap_fp8_block_weights)

DIMS = (256, 256, 512)  # in -> hidden -> out: whole 128-row blocks in each of 2 shards
HEAD = 3  # rows the shards cannot hold as whole blocks: the plain-gather fallback
TOKENS_PER_RANK = 128  # whole 128-token blocks: wgrad's token blocks do not straddle ranks


class _Mesh:
    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def _gather_by_hand(weight: FP8BlockShardedWeight, shards: int, param_dtype=torch.float32):
    parts = torch.chunk(weight, shards, dim=0)
    mp_policy = SimpleNamespace(param_dtype=param_dtype)
    inputs = [p.fsdp_pre_all_gather(_Mesh(shards), weight.shape, weight.stride(), None, mp_policy)
              for p in parts]
    gathered = tuple(torch.cat(ts, dim=0) for ts in zip(*(i[0] for i in inputs)))
    full, _ = parts[0].fsdp_post_all_gather(gathered, inputs[0][1], param_dtype)
    return nn.Parameter(full, requires_grad=True), inputs[0][0]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers = [fb.FP8BlockLinear(DIMS[0], DIMS[1], matmul="reference"), nn.GELU(),
              fb.FP8BlockLinear(DIMS[1], DIMS[2], matmul="reference"), nn.GELU(),
              fb.FP8BlockLinear(DIMS[2], HEAD, matmul="reference")]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("shards", [1, 2, 4])
def test_protocol_by_hand_sends_fp8_and_rebuilds_the_cast(shards):
    w = torch.randn(512, 384)
    wrapped = FP8BlockShardedWeight(w.clone())
    full, sent = _gather_by_hand(wrapped, shards)
    assert isinstance(full.data, FP8BlockGatheredWeight) and full.shape == (512, 384)
    assert sent[0].dtype == torch.uint8 and sent[0].shape == (512 // shards, 384)
    assert sent[1].dtype == torch.float32 and sent[1].shape == (512 // shards // 128, 3)
    assert sum(t.numel() * t.element_size() for t in sent) == fp8_block_gather_bytes(512, 384, shards)
    want, want_t = fb.quantize_weight(w)
    got, got_t = full.data.fp8_pair()
    for g, x in ((got, want), (got_t, want_t)):
        assert torch.equal(g.data.view(torch.uint8), x.data.view(torch.uint8)) and torch.equal(g.scale, x.scale)
    assert fp8_block_gather_bytes(512, 384, 2) / (512 // 2 * 384 * 2) < 0.51  # vs bf16


def test_uneven_or_unaligned_rows_fall_back_to_a_plain_gather():
    wrapped = FP8BlockShardedWeight(torch.randn(3, 256))
    full, sent = _gather_by_hand(wrapped, 2, param_dtype=torch.bfloat16)
    assert not isinstance(full.data, FP8BlockGatheredWeight) and full.dtype == torch.bfloat16
    assert fp8_block_gather_bytes(3, 256, 2) == 0 and fp8_block_gather_bytes(256, 100, 2) == 0


def test_gathered_layer_equals_the_plain_layer():
    """Forward from the gathered FP8 weight (no cast), dgrad from its transpose: bit-equal to
    the unwrapped layer, which casts the master weight."""
    plain = fb.FP8BlockLinear(256, 384, matmul="reference")
    gathered = copy.deepcopy(plain)
    wrap_fp8_block_weights(gathered)
    full, _ = _gather_by_hand(gathered.weight.data, 2)
    gathered.weight = full
    x = torch.randn(70, 256, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    dy = torch.randn(70, 384)
    plain(x).backward(dy)
    y2 = gathered(x2)
    y2.backward(dy)
    assert torch.equal(y2, plain(x.detach()))
    assert torch.equal(x.grad, x2.grad)
    assert torch.equal(plain.weight.grad, full.grad) and torch.equal(plain.bias.grad, gathered.bias.grad)


def test_cast_once_until_the_master_changes():
    s = FP8BlockShardedWeight(torch.randn(256, 128))
    first = s.fp8_shard()
    assert s.fp8_shard() is first and s.casts == 1
    s.add_(0.5)  # in place through the wrapper (what an optimizer step does)
    second = s.fp8_shard()
    assert s.casts == 2
    assert torch.equal(second.dequantize(), fb.quantize_weight(s.master)[0].dequantize())


def test_wrapped_model_trains_and_state_dict_is_plain():
    model = _model()
    ref = copy.deepcopy(model)
    assert wrap_fp8_block_weights(model) == ["0", "2", "4"]
    assert isinstance(model[0].weight.data, FP8BlockShardedWeight)
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    for _ in range(2):
        x = torch.randn(8, 256)
        for m, o in ((model, opt), (ref, opt_ref)):
            m(x).square().mean().backward()
            o.step()
            o.zero_grad()
    state = model.state_dict()
    assert type(state["0.weight"]) is torch.Tensor and state["0.weight"].dtype == torch.float32
    assert all(torch.equal(state[k], v) for k, v in ref.state_dict().items())
    assert all(type(v) is torch.Tensor for v in opt.state[model[0].weight].values())


def test_policy_wraps_only_when_fsdp_shards_the_weights(monkeypatch):
    from gemcore.config import PrecisionConfig
    from gemcore.precision.fp8_block import FP8BlockPrecisionPolicy, make_fp8_block_policy

    # the launcher's environment says several ranks; only the fsdp_size the caller passes counts
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for kwargs in ({}, {"fsdp_size": 1}):
        policy = make_fp8_block_policy(PrecisionConfig(impl="fp8_block"))
        model = policy.apply(_model(), **kwargs)
        assert policy.fp8_gathered == [] and type(model[0].weight.data) is torch.Tensor
    policy = make_fp8_block_policy(PrecisionConfig(impl="fp8_block"))
    model = policy.apply(nn.Sequential(nn.Linear(256, 256)), fsdp_size=2)
    assert policy.fp8_gathered == ["0"] and isinstance(model[0].weight.data, FP8BlockShardedWeight)
    policy = make_fp8_block_policy(PrecisionConfig(impl="fp8_block", fp8_fsdp_all_gather=False))
    model = policy.apply(nn.Sequential(nn.Linear(256, 256)), fsdp_size=2)
    assert policy.fp8_gathered == [] and type(model[0].weight.data) is torch.Tensor
    with pytest.raises(ValueError, match="fsdp_size"):
        policy.apply(_model(), fsdp_size=0)
    with pytest.raises(ValueError, match="fp8_fsdp_all_gather"):
        FP8BlockPrecisionPolicy(fsdp_all_gather="yes")


# --------------------------------------------------------------------------- two ranks
@pytest.mark.mpi
def test_fsdp2_fp8_all_gather_under_torchrun():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(32000 + os.getpid() % 2000), str(Path(__file__).resolve())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for rank in range(2):
        assert f"[rank {rank}] OK" in done.stdout, out[-6000:]


def _worker() -> None:
    """On each rank: FSDP2 over 2 gloo ranks vs the unsharded model on all ranks' tokens."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    ref = _model()
    model = copy.deepcopy(ref)
    wrap_fp8_block_weights(model)
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    sent = []
    real = {n: getattr(dist, n) for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)}

    def counting(fn):
        def wrapper(output, input, *args, **kwargs):
            sent.append(input.numel() * input.element_size())
            return fn(output, input, *args, **kwargs)
        return wrapper

    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(world * TOKENS_PER_RANK, DIMS[0], generator=g)
        mine = x[rank * TOKENS_PER_RANK:(rank + 1) * TOKENS_PER_RANK]
        for name, fn in real.items():
            setattr(dist, name, counting(fn))
        try:
            loss = model(mine).square().mean()
            loss.backward()
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)
        ref_loss = ref(x).square().mean()
        ref_loss.backward()
        losses = [torch.zeros(()) for _ in range(world)]
        dist.all_gather(losses, loss.detach())
        total = sum(losses) / world
        assert torch.allclose(total, ref_loss.detach(), rtol=1e-5), (step, total, ref_loss)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            full = p.grad.full_tensor()
            assert torch.allclose(full, q.grad, rtol=1e-4, atol=1e-6), (step, name, (full - q.grad).abs().max())
        if step == 0:
            # per rank and layer: the FP8 row shard + its scales + the float32 bias shard
            for out_f, in_f in ((DIMS[1], DIMS[0]), (DIMS[2], DIMS[1])):
                want = fp8_block_gather_bytes(out_f, in_f, world) + out_f // world * 4
                assert any(abs(s - want) <= 64 for s in sent), (want, sent)
                assert want < out_f * in_f // world * 2  # below a bf16 gather
            print(f"[rank {rank}] gathered bytes per call: {sent}", flush=True)
        opt.step()
        opt.zero_grad()
        opt_ref.step()
        opt_ref.zero_grad()
    dist.barrier()
    print(f"[rank {rank}] OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
