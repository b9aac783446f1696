"""In-process tests of gemcore.comms: launcher detection, the world-1 backends, argument checks,
the plugin hook, missing optional libraries, and the benchmark's nccl-tests arithmetic.
Multi-rank jobs are in test_comms_ranks.py; the GPU (ce) job in test_comms_ce.py."""
from __future__ import annotations

import sys
import types

import pytest
import torch

from gemcore import comms
from gemcore.bench import comms as bench
from gemcore.comms.launch import detect, detect_placement
from gemcore.hookspecs import hookimpl
from gemcore.plugin_manager import GemPluginManager, PluginError

LAUNCH_VARS = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    comms.finalize()


@pytest.mark.parametrize("env,want", [
    ({}, ("none", 0, 1, 0, 1)),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     ("torchrun", 3, 8, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, ("openmpi", 2, 4, 0, 2)),
    ({"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "3"}, ("mpich", 5, 6, 1, 3)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, ("mpich", 1, 2, None, None)),
    ({"RANK": "0", "WORLD_SIZE": "2"}, ("env", 0, 2, None, None)),
])
def test_detect_launchers(env, want):
    info = detect(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_size) == want
    assert info.under_mpi == (want[0] in ("openmpi", "mpich"))


@pytest.mark.parametrize("env,want", [
    ({}, ("none", 0, 1, 0, 1)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("mpich", 3, 4, 1, 2)),
    ({"PMI_RANK": "3", "PMI_SIZE": "4"}, ("mpich", 3, 4, 3, 4)),  # no local rank: one node
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}, ("openmpi", 1, 2, 1, 2)),
    ({"RANK": "2", "WORLD_SIZE": "3"}, ("env", 2, 3, 2, 3)),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
     ("torchrun", 5, 8, 1, 4)),
])
def test_detect_placement_always_has_a_local_rank(env, want):
    info = detect_placement(env)
    assert (info.launcher, info.rank, info.world_size, info.local_rank, info.local_size) == want


def test_detect_placement_rejects_mpich_rank_outside_the_world():
    with pytest.raises(ValueError, match="PMI_RANK"):
        detect_placement({"PMI_RANK": "4", "PMI_SIZE": "4"})


@pytest.mark.parametrize("env,words", [
    ({"OMPI_COMM_WORLD_RANK": "x", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"PMI_RANK": "0", "PMI_SIZE": "0"}, "PMI_SIZE"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK"),
])
def test_detect_rejects_bad_values(env, words):
    with pytest.raises(ValueError, match=words):
        detect(env)


def test_auto_is_single_for_one_process():
    c = comms.init("auto")
    assert (c.backend, c.rank, c.world_size, c.local_rank, c.local_size) == ("single", 0, 1, 0, 1)
    with pytest.raises(RuntimeError, match="already initialised"):
        comms.init("single")
    assert comms.get() is c


@pytest.mark.parametrize("backend", ["single", "torch", "mpi"])
def test_world_one_collectives(backend):
    if backend == "mpi":
        pytest.importorskip("mpi4py", reason="needs mpi4py (pip install 'gemcore[mpi]')")
    c = comms.init(backend, timeout_s=30)
    assert (c.rank, c.world_size, c.backend) == (0, 1, backend)
    x = torch.randn(5, 3).to(torch.bfloat16)
    assert torch.equal(c.all_gather(x), x)
    assert torch.equal(c.reduce_scatter(x, op="max"), x)
    y = c.all_reduce(x, op="avg")
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
    assert torch.equal(c.all_to_all(x, in_splits=[5]), x)
    assert c.broadcast(x, src=0) is x
    assert torch.equal(c.all_to_all(torch.empty(0, 2)), torch.empty(0, 2))
    c.barrier()
    sub = c.split([0])
    assert (sub.world_size, sub.backend) == (1, backend)
    assert torch.equal(sub.all_gather(x), x)
    sub.finalize()


def test_argument_errors_name_the_argument():
    c = comms.init("single")
    x = torch.zeros(4, 2)
    cases = [
        (lambda: c.all_reduce(x, op="prod"), "op"),
        (lambda: c.all_reduce(x.long(), op="avg"), "avg"),
        (lambda: c.all_reduce(x.bool()), "dtype"),
        (lambda: c.all_to_all(x, in_splits=[3]), "in_splits"),
        (lambda: c.all_to_all(x, in_splits=[1, 3]), "in_splits"),
        (lambda: c.all_to_all(x, in_splits=[4], out_splits=[-1]), "out_splits"),
        (lambda: c.all_to_all(x, in_splits=[4.5]), "in_splits"),
        (lambda: c.broadcast(x, src=1), "src"),
        (lambda: c.broadcast(x, src=True), "src"),
        (lambda: c.all_gather(torch.tensor(1.0)), "t"),
        (lambda: c.all_gather(x.numpy()), "t"),
        (lambda: c.split([0, 0]), "ranks"),
        (lambda: c.split([]), "ranks"),
        (lambda: c.split([[0], [0]]), "partition"),
    ]
    for call, words in cases:
        with pytest.raises(ValueError, match=words):
            call()
    with pytest.raises(ValueError, match="backend"):
        comms.finalize()
        comms.init(backend="")
    with pytest.raises(ValueError, match="timeout_s"):
        comms.init("single", timeout_s=0)


def test_builtin_plugin_offers_every_backend():
    manager = GemPluginManager()
    from gemcore.plugins import comms_backends
    manager.register(comms_backends, name="comms_backends")
    assert set(manager.implementations("communication")) == {"single", "torch", "mpi", "ce"}
    c = comms.init("single", manager=manager)
    assert c.backend == "single"


def test_third_party_backend_through_the_hook():
    from gemcore.comms.single import SingleCommunicator

    class Loud(SingleCommunicator):
        backend = "loud"

    plugin = types.SimpleNamespace(gemcore_comms_backends=hookimpl(lambda: {"loud": Loud}))
    manager = GemPluginManager()
    manager.register(plugin, name="loud_plugin")
    c = comms.init(backend="loud", manager=manager, check=False)
    assert isinstance(c, Loud) and c.backend == "loud" and not c.check
    comms.finalize()
    with pytest.raises(PluginError, match="unknown implementation 'quiet'"):
        comms.init(backend="quiet", manager=manager)


def test_missing_libraries_fail_only_when_selected(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py now raises ImportError
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    c = comms.init("single")  # the package and other backends still work
    comms.finalize()
    with pytest.raises(RuntimeError, match="mpi4py"):
        comms.init("mpi")
    if torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CuPy"):
            comms.init("ce")
    else:
        with pytest.raises(RuntimeError, match="CUDA GPU"):
            comms.init("ce")
    assert c.world_size == 1


def test_single_refuses_a_multi_rank_launch(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="one process"):
        comms.init("single")


@pytest.mark.parametrize("text,want", [("1K", 1024), ("64M", 64 << 20), ("1G", 1 << 30), ("4096", 4096),
                                       ("2KiB", 2048)])
def test_bench_parse_bytes(text, want):
    assert bench.parse_bytes(text) == want


def test_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="--min"):
        bench.parse_bytes("lots", "--min")
    with pytest.raises(ValueError, match="--min"):
        bench.sizes(2048, 1024)
    with pytest.raises(ValueError, match="op"):
        bench.bus_factor("gather", 2)


@pytest.mark.parametrize("op,n,factor", [("all_gather", 8, 7 / 8), ("reduce_scatter", 4, 3 / 4),
                                         ("all_to_all", 2, 1 / 2), ("all_reduce", 8, 14 / 8),
                                         ("broadcast", 8, 1.0)])
def test_bench_bus_factors(op, n, factor):
    assert bench.bus_factor(op, n) == pytest.approx(factor)


def test_bench_rows_world_one(capsys):
    import argparse
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--backend", "single", "--op", "all", "--min", "1K", "--max", "4K",
                         "--iters", "2", "--warmup", "0", "--device", "cpu", "--json"])
    assert bench.run(args) == 0
    import json
    rows = json.loads(capsys.readouterr().out)
    assert [r["op"] for r in rows] == [op for op in bench.OPS for _ in (1024, 2048, 4096)]
    for r in rows:
        assert r["count"] * 4 == r["size_bytes"] and r["time_us"] > 0
        assert r["algbw_gbs"] == pytest.approx(r["size_bytes"] / r["time_us"] / 1e3)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * bench.bus_factor(r["op"], 1))
