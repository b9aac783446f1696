"""gemcore backends under torch.distributed: the conformance suite through the torch.distributed
API under mpirun (1, 3 and 4 ranks), training parity with gloo for every parallelism, faults, and
the process group's refusals."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.test_comms_ranks import MPIRUN, _ends_naming_rank, _env, _fault_job, needs_mpirun

DIST_SUITE = [sys.executable, "-m", "gemcore.comms.dist_conformance"]


@needs_mpirun
@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 3, 4])
def test_torch_distributed_api_on_the_mpi_backend(n):
    """dist.all_gather_into_tensor, reduce_scatter_tensor (sum/avg/max, coalesced), all_reduce,
    all_to_all_single (uneven), broadcast, scatter, gather, send/recv, barrier, functional
    collectives, DeviceMesh sub-groups and DTensor, on a gemcore_mpi default group."""
    cmd = [str(MPIRUN), "-n", str(n), "--oversubscribe", *DIST_SUITE, "--backend", "mpi"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for rank in range(n):
        assert f"[rank {rank}] gemcore_mpi: " in proc.stdout, out[-6000:]


@needs_mpirun
@pytest.mark.mpi
@pytest.mark.parametrize("fault,words", [("raise", "[rank 1] RuntimeError: planted fault"),
                                         ("mismatch", "MismatchError"),
                                         ("exit", "Exit code")])
def test_a_fault_ends_the_job_naming_the_rank(fault, words):
    cmd = [str(MPIRUN), "-n", "2", "--oversubscribe", *DIST_SUITE, "--backend", "mpi", "--fault", fault]
    code, out, after = _fault_job(cmd, timeout=120)
    _ends_naming_rank(code, out, after, words)
    if fault == "mismatch":
        assert "all_gather" in out and "rank 1" in out, out[-3000:]


def _metrics(run_dir) -> list[tuple[float, float]]:
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [(r["loss"], r["grad_norm"]) for r in rows if "loss" in r]


LAYOUTS = {
    "fsdp": ["--parallel", "fsdp"],
    "tp": ["--parallel", "planned", "--set", "parallelism.degrees=tp=2"],
    "pp": ["--parallel", "planned", "--set", "parallelism.degrees=pp=2"],
    "ep": ["--parallel", "planned", "--set", "parallelism.degrees=dp_shard=2,ep=2", "--set", "model.moe_experts=4"],
    "cp": ["--parallel", "planned", "--set", "parallelism.degrees=cp=2"],
}


@needs_mpirun
@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_training_on_the_mpi_backend_matches_gloo(layout, tmp_path, tiny_args):
    """Every parallelism's collectives through comms.backend=mpi: the same losses and gradient
    norms as torch's gloo, within 1e-5, and the run says which backend carried the mesh."""
    runs = {}
    for backend in ("none", "mpi"):
        cmd = [str(MPIRUN), "-n", "2", "--oversubscribe", sys.executable, "-m", "gemcore.cli.main", "train",
               "--max-steps", "3", "--name", backend, *LAYOUTS[layout], *tiny_args(["model.num_blocks=2"]),
               "--set", f"comms.backend={backend}"]
        proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        runs[backend] = _metrics(tmp_path / "runs" / backend)
        summary = json.loads((tmp_path / "runs" / backend / "summary.json").read_text())
        carried = set(summary["mesh_carriers"].values())
        assert carried == ({"gemcore_mpi"} if backend == "mpi" else {"gloo"}), summary["mesh_carriers"]
    assert len(runs["mpi"]) == len(runs["none"]) == 3
    for (loss_m, norm_m), (loss_g, norm_g) in zip(runs["mpi"], runs["none"]):
        assert abs(loss_m - loss_g) <= 1e-5 and abs(norm_m - norm_g) <= 1e-5, (runs["mpi"], runs["none"])


# ---------------------------------------------------------------------- one process
@pytest.fixture
def single_group():
    import torch.distributed as dist

    from gemcore import comms
    from gemcore.comms.process_group import CommunicatorProcessGroup

    comm = comms.init("single")
    try:
        yield comm, CommunicatorProcessGroup
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        comms.finalize()


def test_an_unsupported_op_names_the_op_and_the_backend(single_group):
    comm, group_class = single_group
    group = group_class(comm, ("cpu",))
    with pytest.raises(NotImplementedError, match="recv_anysource is not implemented by the gemcore_single"):
        group.recv_anysource([torch.zeros(1)], 0)
    import torch.distributed as dist

    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.PRODUCT
    with pytest.raises(NotImplementedError, match=r"reduce op .* gemcore_single"):
        group.allreduce([torch.ones(2)], opts)


def test_a_tensor_on_a_device_the_backend_does_not_serve_names_both(single_group):
    comm, group_class = single_group
    group = group_class(comm, ("cuda",))
    with pytest.raises(ValueError, match=r"all_reduce: the gemcore_single process group serves cuda tensors, got one on cpu"):
        group.allreduce([torch.ones(2)])


def test_a_world_of_one_runs_through_the_default_group(single_group):
    import torch.distributed as dist

    from gemcore.comms import process_group

    comm, _ = single_group
    assert process_group.init_process_group(comm) == "gemcore_single"
    x = torch.arange(4.0)
    out = torch.empty(4)
    dist.all_gather_into_tensor(out, x)
    assert torch.equal(out, x)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    assert torch.equal(x, torch.arange(4.0))
    assert dist.get_backend() == "gemcore_single"


def test_unknown_backend_is_exit_2_listing_the_available(tmp_path, monkeypatch, tiny_args):
    from tests.conftest import gem

    result = gem(["train", "--max-steps", "1", *tiny_args(), "--set", "comms.backend=nope"], tmp_path, monkeypatch)
    assert result.returncode == 2
    text = result.stdout + result.stderr
    assert "nope" in text and "mpi" in text and "ce" in text and "torch" in text, text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_ce_without_cuda_is_a_one_line_error(tmp_path, monkeypatch, tiny_args):
    from tests.conftest import gem

    result = gem(["train", "--max-steps", "1", *tiny_args(), "--set", "comms.backend=ce"], tmp_path, monkeypatch)
    assert result.returncode != 0
    text = (result.stdout + result.stderr).strip()
    assert "needs a CUDA GPU" in text, text


@needs_mpirun
@pytest.mark.mpi
def test_bench_comms_step_reports_each_backend_against_the_first():
    cmd = [str(MPIRUN), "-n", "2", "--oversubscribe", sys.executable, "-m", "gemcore.cli.main", "bench",
           "comms_step", "--backends", "torch,mpi", "--repeats", "1", "--steps", "2", "--warmup", "0",
           "--users", "4", "--max-len", "16", "--hidden", "16", "--blocks", "1", "--json"]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    rows = {r["backend"]: r for r in report["rows"]}
    assert set(rows) == {"torch", "mpi"} and report["ranks"] == 2
    assert rows["torch"]["ratio"] == 1.0 and rows["mpi"]["step_ms"] > 0
    assert rows["mpi"]["max_loss_diff"] <= 1e-5


def test_bench_comms_step_refuses_one_process(capsys):
    import argparse

    from gemcore.bench import comms_step

    p = argparse.ArgumentParser()
    comms_step.add_arguments(p)
    with pytest.raises(SystemExit, match="at least 2 ranks"):
        comms_step.run(p.parse_args([]))
    with pytest.raises(SystemExit, match="--steps must be >= 1"):
        comms_step.run(p.parse_args(["--steps", "0"]))


def test_a_host_collectives_work_is_complete_and_holds_its_result():
    """The Work of a collective on CPU tensors: done when returned; its future and result hold
    the outputs (the CUDA stream semantics are checked by the dist suite on the GPU)."""
    from gemcore.comms.process_group import _completed

    out = torch.arange(4.0)
    work = _completed([out], [out])
    assert work.wait() is True and work.is_completed()
    (got,) = work.get_future().wait()
    assert got is out and work.result() == [out]
