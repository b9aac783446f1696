"""Applying plans on torch.distributed (gloo, CPU ranks under torchrun): losses and gradient norms
of FSDP2, HSDP, FSDP2 x TP, FSDP2 x EP and context-parallel runs of GemModel, and of TP runs in
precision mxfp8, match a single-process run step for step."""
import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from gemcore.parallel.apply import check_supported
from gemcore.planner.plan import Plan
from gemcore.bench.planner_smoke import main as smoke_main

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, degrees: str, *extra: str, report: dict | None = None) -> list[float]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-port", str(_free_port()), "-m", "gemcore.bench.planner_smoke", "--degrees", degrees,
           "--steps", str(STEPS), "--same-batch", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]
    out = json.loads(line)
    if report is not None:
        report.update(out)
    return out["losses"] + out["grad_norms"]


def _reference(capsys, *extra: str) -> list[float]:
    assert smoke_main(["--steps", str(STEPS), "--same-batch", *extra]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return out["losses"] + out["grad_norms"]


@pytest.mark.parametrize("nproc, degrees, extra", [
    (2, "dp_shard=2,ac=full", ()),
    (4, "dp_shard=2,tp=2", ()),
    (4, "dp_replicate=2,dp_shard=2", ("--experts", "4")),
    (2, "dp_shard=2,ep=2", ("--experts", "4")),
    # experts split over ep=2 and FSDP2-sharded over the other 2 ranks (expert FSDP), recomputed
    (4, "dp_shard=4,ep=2,ac=full", ("--experts", "4")),
    # HSDP with experts: split over dp_shard, replicated (HSDP, shard 1) over dp_replicate
    (4, "dp_replicate=2,dp_shard=2,ep=2", ("--experts", "4")),
    # experts split over ep and each one tensor-parallel over tp
    (4, "dp_shard=2,ep=2,tp=2", ("--experts", "4")),
    # one long user: its history is cut between the ranks (continuation + K/V carry), recomputed
    (2, "cp=2,ac=full", ("--batch", "1", "--max-len", "40")),
    (4, "dp_shard=2,cp=2,ac=selective", ("--experts", "4")),
    (4, "cp=2,tp=2", ()),
])
def test_plan_losses_match_single_process(capsys, nproc, degrees, extra):
    expected = _reference(capsys, *extra)
    assert expected[STEPS - 1] < expected[0] - 0.01  # the run really trains (same batch every step)
    got = _torchrun(nproc, degrees, *extra)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_unapplied_dimensions_are_named():
    assert check_supported(Plan(dp_shard=2, tp=2)) == []
    assert check_supported(Plan(dp_shard=2, ep=2)) == []
    assert check_supported(Plan(dp_replicate=2, dp_shard=2, cp=2, tp=2)) == []
    assert check_supported(Plan(pp=2, dp_shard=2)) == []                      # tests/test_planner_pipeline.py
    assert check_supported(Plan(cp=2, pp=2, dp_shard=2)) == []                # tests/test_planner_cp_combos.py
    assert check_supported(Plan(dp_shard=2, cp=2, ep=2)) == []                # experts beside cp
    assert check_supported(Plan(dp_shard=2, tp=2, ep=2)) == []                # experts TP-sharded too
    assert check_supported(Plan(dp_shard=4, ep=2)) == []                      # experts FSDP over 2
    assert check_supported(Plan(dp_replicate=2, dp_shard=2, ep=2)) == []
    assert check_supported(Plan(pp=2, dp_shard=4, ep=2)) == []                # expert FSDP in stages


@pytest.mark.parametrize("nproc, degrees, mx_gathered", [(2, "tp=2", False), (4, "dp_shard=2,tp=2", True)])
def test_mxfp8_under_tensor_parallelism_matches_single_process(capsys, nproc, degrees, mx_gathered):
    """precision mxfp8: MX layers on tensor-parallel shards (hidden 64: every split on 32-element MX
    block borders, so each rank's blocks are the unsplit layer's), alone and under FSDP2, where the
    split weights' local shards are all-gathered in MX (cast from the master shards)."""
    extra = ("--mx", "--hidden", "64")
    expected = _reference(capsys, *extra)
    report = {}
    got = _torchrun(nproc, degrees, *extra, report=report)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert (report["mx_gathered"] > 0) == mx_gathered, report


def test_plugin_registers_its_names():
    from gemcore.plugin_manager import create_plugin_manager

    manager = create_plugin_manager([])
    for name in ("fsdp", "planned", "auto"):
        impl = manager.resolve("parallelism", name)
        assert impl is not None


def test_cuda_run_with_more_local_ranks_than_gpus_is_refused_by_name():
    from gemcore.parallel.planned import init_process_group

    visible = torch.cuda.device_count()
    env = {"rank": visible, "world_size": visible + 1, "local_rank": visible, "local_world_size": visible + 1}
    with pytest.raises(ValueError, match=rf"run.device = 'cuda'.*{visible + 1} processes.*{visible} CUDA device"):
        init_process_group(env, "cuda")


def test_the_process_group_follows_the_runs_device_not_the_machine(monkeypatch):
    """A CPU run on a machine with a GPU (the CPU tests under mpirun there) joins with gloo."""
    import torch.distributed as dist

    from gemcore.config import Config
    from gemcore.parallel import planned

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: calls.append(backend))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert planned._device(Config()) == "cpu"            # run.device = "cpu"
    assert planned.init_process_group({"rank": 0, "world_size": 2, "local_rank": 0,
                                       "local_world_size": 2}, planned._device(Config()))
    assert calls == ["gloo"]
    assert planned._device(None) == "cuda"               # no run config: the machine's GPU


def test_a_backend_asked_for_a_device_it_does_not_serve_names_both():
    from types import SimpleNamespace

    from gemcore.parallel.planned import init_process_group

    ce = SimpleNamespace(backend="ce")
    with pytest.raises(ValueError, match=r"comms.backend = 'ce' serves cuda tensors, but run.device = 'cpu'"):
        init_process_group({"rank": 0, "world_size": 2, "local_rank": 0, "local_world_size": 2}, "cpu", ce)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_smoke_refuses_cuda_without_a_gpu(capsys):
    with pytest.raises(SystemExit) as exc:
        smoke_main(["--device", "cuda", "--steps", "1"])
    assert exc.value.code == 2
    assert "--device cuda" in capsys.readouterr().err


def test_clip_grad_norm_groups_dtensor_gradients_and_refuses_partial_sums(one_rank_group):
    """The squared norms of DTensor gradients are reduced per (mesh, placements) group: on a
    one-rank mesh the clipped gradients and the norm equal torch's; a gradient still holding
    partial sums is refused."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

    from gemcore.parallel.apply import clip_grad_norm_

    mesh = init_device_mesh("cpu", (1,))
    torch.manual_seed(0)
    grads = [torch.randn(6, 4), torch.randn(5), torch.randn(3, 3)]
    plain = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    split = [torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), mesh, [pl]))
             for g, pl in zip(grads, [Shard(0), Replicate(), Shard(1)])]
    for p, q, g in zip(plain, split, grads):
        p.grad = g.clone()
        q.grad = distribute_tensor(g.clone(), mesh, q.placements)
    want = torch.nn.utils.clip_grad_norm_(plain, 0.5)
    got = clip_grad_norm_(split, 0.5)
    torch.testing.assert_close(got, want)
    for p, q in zip(plain, split):
        torch.testing.assert_close(q.grad.full_tensor(), p.grad)
    q = split[0]
    q.grad = torch.distributed.tensor.DTensor.from_local(torch.ones(6, 4), mesh, [Partial()])
    with pytest.raises(ValueError, match="partial sums"):
        clip_grad_norm_([q], 0.5)


def test_clip_grad_norm_of_a_stage_without_gradients_joins_the_pipeline_reduction(one_rank_group):
    """A pipeline stage whose parameters got no gradient still all-reduces its (zero) squared norm
    over the pp group, on the group's device, and scales nothing; with gradients the total is the
    usual one."""
    from gemcore.parallel.apply import clip_grad_norm_

    idle = torch.nn.Parameter(torch.ones(3))
    total = clip_grad_norm_([idle], 1.0, pp_group=one_rank_group)
    assert total.device.type == "cpu" and float(total) == 0.0 and idle.grad is None
    busy = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    busy.grad = torch.full((4,), 2.0, dtype=torch.bfloat16)
    plain = torch.nn.Parameter(torch.zeros(3))
    plain.grad = torch.full((3,), 2.0)
    total = clip_grad_norm_([busy, plain], 1.0, pp_group=one_rank_group)
    assert float(total) == pytest.approx(math.sqrt(7 * 4.0))          # float32 norms, mixed dtypes
    assert busy.grad.dtype == torch.bfloat16
    torch.testing.assert_close(plain.grad, torch.full((3,), 2.0 / math.sqrt(28.0)), rtol=1e-5, atol=0)
