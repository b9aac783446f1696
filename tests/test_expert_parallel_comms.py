"""Expert parallelism through gemcore.comms: the differentiable all-to-all
(gemcore.comms.autograd.all_to_all) against a single-process reference, and ExpertParallelMoE over
an MPI sub-communicator (split off the job's communicator to a gloo ProcessGroup's ranks) and over
the torch backend wrapping that group, against the unsplit MoE: outputs and every gradient.

The multi-rank part runs this file as a script under ``mpirun -n 3`` (an odd world, plus a
sub-group of 2 whose ranks are not consecutive); every rank prints ``[rank R] OK <case>``. The
end-to-end part trains the planner's smoke model with dp_shard=2 x ep=2 under ``mpirun -n 2`` with
``comms.init("mpi")`` (experts through MPI, FSDP through gloo) against one process.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BIN = Path(sys.executable).parent
MPIRUN = shutil.which("mpirun", path=os.pathsep.join([str(BIN), os.environ.get("PATH", "")]))
try:
    import mpi4py  # noqa: F401
    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False
needs_mpirun = pytest.mark.skipif(not (MPIRUN and HAVE_MPI4PY),
                                  reason="needs mpi4py and mpirun (pip install 'gemcore[mpi]')")

RANKS = 3


# ---------------------------------------------------------------------------- references
def _split_matrix(world: int, seed: int) -> list[list[int]]:
    """S[i][j]: rows rank i sends to rank j; uneven, with zero-length chunks, and the last rank
    sending nothing at all (an empty input)."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 4, (world, world), generator=g)
    s[0, world - 1] = 0
    s[world - 1] = 0
    return s.tolist()


def _a2a_case(world: int, seed: int, dtype: torch.dtype):
    """Inputs X_i, loss weights W_j and the reference output Y_j and input gradients of
    L = sum_j sum(Y_j**2 * W_j), all in one process."""
    s = _split_matrix(world, seed)
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(sum(s[i]), 5, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
          for i in range(world)]
    ws = [torch.randn(sum(s[i][j] for i in range(world)), 5, generator=g, dtype=torch.float64).to(dtype)
          for j in range(world)]
    chunks = [x.split(s[i]) for i, x in enumerate(xs)]
    ys = [torch.cat([chunks[i][j] for i in range(world)]) for j in range(world)]
    sum((y * y * w).sum() for y, w in zip(ys, ws)).backward()
    return s, xs, ws, ys


def _moe_inputs(world: int, hidden: int, tokens: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, hidden, generator=g, dtype=torch.float64) for t in tokens]
    ws = [torch.randn(t, hidden, generator=g, dtype=torch.float64) for t in tokens]
    return xs, ws


def _make_moe(hidden: int, experts: int):
    from gemcore.model import MoEMLP

    torch.manual_seed(0)
    return MoEMLP(hidden, 2 * hidden, experts, top_k=2).double()


class _Blocks(torch.nn.Module):
    """The part of GemModel apply_ep looks at: ``blocks[i].mlp``."""

    def __init__(self, moe):
        super().__init__()
        block = torch.nn.Module()
        block.mlp = moe
        self.blocks = torch.nn.ModuleList([block])


# ---------------------------------------------------------------------------- multi-rank worker
def _check_all_to_all(comm, world_rank: int, label: str) -> None:
    """Forward and gradient of this rank's part, for given and exchanged out_splits, float64 and
    float32, against :func:`_a2a_case`."""
    from gemcore.comms.autograd import all_to_all

    r, w = comm.rank, comm.world_size
    for seed, dtype, tol in [(11, torch.float64, 1e-12), (23, torch.float32, 1e-5), (37, torch.float64, 1e-12)]:
        s, xs, ws, ys = _a2a_case(w, seed, dtype)
        for given in (True, False):
            x = xs[r].detach().clone().requires_grad_()
            out_splits = [s[i][r] for i in range(w)] if given else None
            y = all_to_all(comm, x, s[r], out_splits)
            (y * y * ws[r]).sum().backward()
            torch.testing.assert_close(y, ys[r].detach(), rtol=tol, atol=tol)
            torch.testing.assert_close(x.grad, xs[r].grad, rtol=tol, atol=tol)
    ints = torch.arange(w * 2, dtype=torch.int64) + 100 * r          # even split, no gradient
    got = all_to_all(comm, ints)
    assert got.tolist() == [100 * i + 2 * r + k for i in range(w) for k in range(2)], got
    print(f"[rank {world_rank}] OK all_to_all {label}", flush=True)


def _check_moe(ep_group, parent, expect_backend: str, world_rank: int, label: str) -> None:
    """ExpertParallelMoE over ``ep_group`` (through apply_ep, communicator derived from ``parent``)
    against the unsplit MoE on the same tokens: outputs, input, router and expert gradients."""
    import torch.distributed as dist

    from gemcore import comms
    from gemcore.parallel.expert import EP_GROUP_ATTR, apply_ep

    ep, r = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    hidden, experts = 6, 2 * ep
    tokens = [7, 0, 5, 3][:ep]                                       # a rank with no tokens
    xs, ws = _moe_inputs(ep, hidden, tokens, seed=5)

    # reference: the whole MoE on every rank's tokens in one process
    ref = _make_moe(hidden, experts)
    x_ref = [x.clone().requires_grad_() for x in xs]
    outs = [ref(x) for x in x_ref]
    total = sum((o * w).sum() for o, w in zip(outs, ws))
    expert_grads = torch.autograd.grad(total, list(ref.experts.parameters()), retain_graph=True)
    own = (outs[r] * ws[r]).sum()                                    # the router is replicated: own loss
    if own.requires_grad:
        router_grad, x_grad = torch.autograd.grad(own, [ref.router.weight, x_ref[r]])
    else:                                                            # no tokens here: no path at all
        router_grad, x_grad = torch.zeros_like(ref.router.weight), torch.zeros_like(x_ref[r])

    model = apply_ep(_Blocks(_make_moe(hidden, experts)), ep_group, data_parallel_size=ep, comm=parent)
    layer = model.blocks[0].mlp
    assert layer.comm.backend == expect_backend, layer.comm
    assert layer.comm.check == (parent or comms.get()).check         # the job's comms.check setting
    assert (layer.comm.rank, layer.comm.world_size) == (r, ep)
    x = xs[r].clone().requires_grad_()
    out = layer(x)
    (out * ws[r]).sum().backward()
    torch.testing.assert_close(out, outs[r].detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x.grad, x_grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.router.weight.grad, router_grad, rtol=1e-10, atol=1e-12)
    per_expert = len(list(ref.experts[0].parameters()))
    mine = expert_grads[r * (experts // ep) * per_expert:(r + 1) * (experts // ep) * per_expert]
    for p, g in zip(layer.experts.parameters(), mine, strict=True):
        assert getattr(p, EP_GROUP_ATTR) is ep_group                 # clip_grad_norm_ reduces over it
        torch.testing.assert_close(p.grad, g / ep, rtol=1e-10, atol=1e-12)  # summed over ranks / dp
    print(f"[rank {world_rank}] OK moe {label}", flush=True)


def _worker() -> None:
    import torch.distributed as dist

    from gemcore import comms
    from gemcore.comms.torch_backend import TorchCommunicator

    world = comms.init("mpi")                     # the job's communicator (comms.backend = "mpi")
    tc = TorchCommunicator()                      # gloo default group, rendezvous through MPI
    rank, n = world.rank, world.world_size
    all_pg = dist.new_group(list(range(n)))
    pair = [0, n - 1]                             # a sub-group whose ranks are not consecutive
    pair_pg = dist.new_group(pair)
    rest_pg = dist.new_group([r for r in range(n) if r not in pair])
    in_pair = rank in pair
    my_pg = pair_pg if in_pair else rest_pg

    ep_mpi = comms.group_communicator(all_pg)     # parent: the current (mpi) communicator -> split
    assert ep_mpi.backend == "mpi" and ep_mpi.comm != world.comm, ep_mpi
    ep_torch = comms.from_process_group(all_pg)
    assert ep_torch.backend == "torch" and ep_torch.group is all_pg
    _check_all_to_all(world, rank, "mpi-world")
    _check_all_to_all(ep_mpi, rank, "mpi-split")
    _check_all_to_all(ep_torch, rank, "torch-wrap")
    _check_all_to_all(comms.from_process_group(all_pg, check=False), rank, "torch-nocheck")

    pair_mpi = comms.group_communicator(my_pg)    # split is collective over the parent: every rank
    if in_pair:
        assert (pair_mpi.rank, pair_mpi.world_size) == (pair.index(rank), 2)
        _check_all_to_all(pair_mpi, rank, "mpi-pair")
        _check_all_to_all(comms.from_process_group(pair_pg), rank, "torch-pair")
    else:
        with pytest.raises(ValueError, match="not a member"):
            comms.from_process_group(pair_pg)
        print(f"[rank {rank}] OK non-member refused", flush=True)

    _check_moe(all_pg, None, "mpi", rank, "mpi")                     # default parent: comms.get()
    _check_moe(all_pg, tc, "torch", rank, "torch")                   # a torch parent wraps the group
    if in_pair:
        _check_moe(pair_pg, world, "mpi", rank, "mpi-pair")
    else:                                         # joins the split of apply_ep on the pair
        comms.group_communicator(rest_pg, world).finalize()

    ep_torch.finalize()                           # not the owner: the groups survive
    ok = torch.ones(1)
    dist.all_reduce(ok, group=all_pg)
    assert dist.is_initialized() and ok.item() == n
    ep_mpi.finalize()
    pair_mpi.finalize()
    dist.barrier()
    comms.finalize()
    tc.finalize()                                 # owns the default group: destroys it
    assert not dist.is_initialized()
    print(f"[rank {rank}] OK finalize", flush=True)


# ---------------------------------------------------------------------------- tests
def _env() -> dict[str, str]:
    env = dict(os.environ)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "GEMCORE_COMMS_NODE"):
        env.pop(name, None)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


def _smoke_worker(argv: list[str]) -> int:
    """The planner's smoke run with the job's communicator on MPI (``comms.backend = "mpi"``)."""
    import logging

    from gemcore import comms
    from gemcore.bench.planner_smoke import main

    log = logging.getLogger("gemcore.parallel.expert")    # says which backend apply_ep chose
    log.addHandler(logging.StreamHandler(sys.stdout))
    log.setLevel(logging.INFO)
    comms.init("mpi")
    rc = main(argv)
    comms.finalize()
    return rc


@pytest.mark.mpi
@needs_mpirun
def test_plan_with_experts_through_mpi_matches_single_process(capsys):
    """apply_plan's apply_ep picks the job's MPI communicator (split to the dp_shard group's ranks):
    losses and pre-clip gradient norms of dp_shard=2 x ep=2 match one process."""
    from gemcore.bench.planner_smoke import main as smoke_main

    args = ["--experts", "4", "--steps", "3", "--same-batch"]
    assert smoke_main(args) == 0
    expected = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = {**_env(), "MASTER_ADDR": "localhost", "MASTER_PORT": str(port)}
    cmd = [str(MPIRUN), "-n", "2", "--oversubscribe", sys.executable, "-m", "mpi4py", __file__, "--smoke",
           "--degrees", "dp_shard=2,ep=2", *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    assert "ep=2" in got["plan"] and "ep=2 through mpi: rank 1/2" in proc.stdout, proc.stdout[-2000:]
    assert got["losses"] + got["grad_norms"] == pytest.approx(expected["losses"] + expected["grad_norms"],
                                                              rel=1e-5, abs=1e-6)
    assert expected["losses"][-1] < expected["losses"][0] - 0.01   # it trains


@pytest.mark.mpi
@needs_mpirun
def test_expert_parallel_through_mpi_and_torch_communicators():
    cmd = [str(MPIRUN), "-n", str(RANKS), "--oversubscribe", sys.executable, "-m", "mpi4py", __file__]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out[-6000:]}"
    cases = ["all_to_all mpi-world", "all_to_all mpi-split", "all_to_all torch-wrap", "all_to_all torch-nocheck",
             "moe mpi", "moe torch",
             "finalize"]
    for rank in range(RANKS):
        paired = rank in (0, RANKS - 1)
        extra = ["all_to_all mpi-pair", "all_to_all torch-pair", "moe mpi-pair"] if paired else [
            "non-member refused"]
        for case in cases + extra:
            assert f"[rank {rank}] OK {case}\n" in proc.stdout, f"rank {rank}: {case} did not pass\n{out[-6000:]}"


def test_all_to_all_one_rank_gradcheck():
    """World 1 (the ``single`` backend): the exchange is the identity, gradients included, for
    empty and one-row tensors; second derivatives flow too."""
    from gemcore.comms.autograd import all_to_all
    from gemcore.comms.single import SingleCommunicator

    comm = SingleCommunicator()
    for rows in (0, 1, 4):
        x = torch.randn(rows, 3, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(lambda t, n=rows: all_to_all(comm, t, [n], [n]) ** 2, (x,))
        assert torch.autograd.gradgradcheck(lambda t: all_to_all(comm, t) ** 3, (x,))


def test_bad_arguments_name_themselves():
    from gemcore import comms
    from gemcore.comms.autograd import all_to_all
    from gemcore.comms.single import SingleCommunicator
    from gemcore.parallel.expert import ExpertParallelMoE, apply_ep

    comm = SingleCommunicator()
    with pytest.raises(ValueError, match="comm must be"):
        all_to_all(None, torch.zeros(2, 1))
    with pytest.raises(ValueError, match="in_splits"):
        all_to_all(comm, torch.zeros(2, 1), [1, 1])
    with pytest.raises(ValueError, match="out_splits"):
        all_to_all(comm, torch.zeros(2, 1), [2], [-2])
    with pytest.raises(ValueError, match="t must"):
        all_to_all(comm, [1, 2])
    with pytest.raises(ValueError, match="group must"):
        comms.group_communicator("dp_shard")
    with pytest.raises(ValueError, match="parent must"):
        comms.group_communicator(None, parent="mpi")
    with pytest.raises(ValueError, match="data_parallel_size"):
        ExpertParallelMoE(_make_moe(4, 2), comm, 0)
    with pytest.raises(ValueError, match="group must"):
        ExpertParallelMoE(_make_moe(4, 2), "ep", 1)
    dense = _Blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="needs a model with experts"):
        apply_ep(dense, comm, 1)


def test_one_rank_moe_and_wrapping(one_rank_group):
    """ep = 1 through the torch backend over a ProcessGroup (apply_ep's default without comms.init)
    and through a Communicator: the same function and gradients as the MoE; finalize of a wrapped
    group leaves it to its owner."""
    import torch.distributed as dist

    from gemcore import comms
    from gemcore.comms.single import SingleCommunicator
    from gemcore.parallel.expert import EP_GROUP_ATTR, ExpertParallelMoE, apply_ep

    xs, ws = _moe_inputs(1, 6, [9], seed=3)
    ref = _make_moe(6, 4)
    x_ref = xs[0].clone().requires_grad_()
    out_ref = ref(x_ref)
    (out_ref * ws[0]).sum().backward()
    for make in (lambda m: apply_ep(_Blocks(m), one_rank_group, 1).blocks[0].mlp,
                 lambda m: ExpertParallelMoE(m, SingleCommunicator(), 1)):
        layer = make(_make_moe(6, 4))
        assert layer.comm.check is (layer.comm.backend == "single")   # no comms.init: apply_ep skips checks
        x = xs[0].clone().requires_grad_()
        out = layer(x)
        (out * ws[0]).sum().backward()
        torch.testing.assert_close(out, out_ref, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
        for p, q in zip(layer.parameters(), ref.parameters(), strict=True):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    assert getattr(next(layer.experts.parameters()), EP_GROUP_ATTR) is layer.comm

    wrapped = comms.from_process_group(one_rank_group)
    assert (wrapped.backend, wrapped.rank, wrapped.world_size) == ("torch", 0, 1)
    wrapped.finalize()
    assert dist.is_initialized()
    assert wrapped.__class__.wrap(None).all_reduce(torch.ones(2)).tolist() == [1.0, 1.0]


def test_cpu_tensors_staged_only_on_nccl_only_groups(monkeypatch):
    """A group whose only backend is NCCL gets CPU tensors staged through the current CUDA device;
    groups with a CPU backend do not (the staging itself needs a GPU and is not run here)."""
    import torch.distributed as dist

    from gemcore.comms import torch_backend

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    for name, staged in [("nccl", True), ("cpu:gloo,cuda:nccl", False), ("gloo", False),
                         ("cuda:nccl", True), ("undefined", False), ("mpi", False)]:
        monkeypatch.setattr(dist, "get_backend", lambda group=None, n=name: n)
        want = torch.device("cuda", 3) if staged else None
        assert torch_backend._staging_device(None) == want, name


if __name__ == "__main__":
    if sys.argv[1:2] == ["--smoke"]:
        sys.exit(_smoke_worker(sys.argv[2:]))
    _worker()
