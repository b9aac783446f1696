"""The benchmark's flags and the --overlap-gemm / one-GPU transfer demo arithmetic, on CPU
(the GPU measurement itself runs on a GPU machine; see docs/comms.md)."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from gemcore.bench import comms as bench
from gemcore.bench import comms_overlap as overlap


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def test_issue_flags_and_old_aliases():
    new = _parse(["--op", "all_gather,broadcast", "--min", "1K", "--max", "1G"])
    old = _parse(["--op", "all_gather,broadcast", "--min-bytes", "1K", "--max-bytes", "1G"])
    for args in (new, old):
        assert bench.parse_bytes(args.min_bytes) == 1 << 10 and bench.parse_bytes(args.max_bytes) == 1 << 30
        assert bench.sizes(bench.parse_bytes(args.min_bytes), bench.parse_bytes(args.max_bytes))[-1] == 1 << 30
    assert not new.overlap_gemm and _parse(["--overlap-gemm"]).overlap_gemm


@pytest.mark.parametrize("argv,words", [
    (["--op", "gather"], "--op"),
    (["--min", "2K", "--max", "1K"], "--min"),
    (["--min", "big"], "--min"),
    (["--overlap-gemm", "--device", "cpu"], "--overlap-gemm"),
    (["--overlap-gemm", "--gemm-n", "0"], "--gemm-n"),
    (["--overlap-gemm", "--gemm-iters", "0"], "--gemm-iters"),
])
def test_bad_flags_name_the_flag(argv, words):
    with pytest.raises(ValueError, match=words):
        bench.run(_parse(["--backend", "single", "--device", "cpu", *argv]))


def test_gemm_arithmetic():
    assert overlap.gemm_flops(8192) == 2 * 8192 ** 3
    # 40 GEMMs of 8192^3 in 66.2 ms is about 664 TFLOP/s (an H200's dense bf16 GEMM rate)
    assert overlap.tflops(40 * overlap.gemm_flops(8192), 0.0662) == pytest.approx(664.3, rel=1e-3)
    assert overlap.slowdown_pct(664.0, 602.0) == pytest.approx(9.34, abs=0.01)
    assert overlap.slowdown_pct(664.0, 666.0) < 0  # faster during: a negative slowdown, not clipped
    with pytest.raises(ValueError, match="seconds"):
        overlap.tflops(1.0, 0.0)
    with pytest.raises(ValueError, match="alone"):
        overlap.slowdown_pct(0.0, 1.0)


@pytest.mark.parametrize("inner,outer,want", [
    ((0, 10), (0, 10), 1.0), ((0, 10), (-5, 20), 1.0), ((0, 10), (5, 20), 0.5), ((0, 10), (2, 4), 0.2),
    ((0, 10), (10, 20), 0.0), ((0, 10), (-3, -1), 0.0), ((3, 3), (0, 5), 1.0), ((3, 3), (4, 5), 0.0),
])
def test_coverage(inner, outer, want):
    assert overlap.coverage(inner, outer) == pytest.approx(want)


def test_coverage_rejects_reversed_intervals():
    with pytest.raises(ValueError, match="start <= end"):
        overlap.coverage((2, 1), (0, 5))


def test_calls_to_cover():
    # 66 ms of GEMMs, 4 ms per call: twice the loop plus one call
    assert bench.calls_to_cover(0.066, 0.004) == math.ceil(2 * 0.066 / 0.004) + 1
    assert bench.calls_to_cover(0.066, 10.0) == 2  # a call longer than the loop: still two
    assert bench.calls_to_cover(1.0, 1e-9, max_calls=500) == 500
    for loop_s, call_s in [(0.0, 1.0), (1.0, 0.0), (float("nan"), 1.0)]:
        with pytest.raises(ValueError, match="positive"):
            bench.calls_to_cover(loop_s, call_s)


def test_parse_transfers():
    assert overlap.parse_transfers("host, device,host") == ["host", "device"]
    assert overlap.parse_transfers("all") == list(overlap.TRANSFERS)
    for bad in ("", "nvlink", "host,,d2d"):
        with pytest.raises(ValueError, match="--transfer"):
            overlap.parse_transfers(bad)


def test_transfer_demo_validates_before_touching_a_gpu():
    p = argparse.ArgumentParser()
    overlap.add_arguments(p)
    for argv, words in [(["--transfer", "x"], "--transfer"), (["--size", "lots"], "--size"),
                        (["--gemm-n", "-1"], "--gemm-n"), (["--repeats", "0"], "--repeats")]:
        with pytest.raises(ValueError, match=words):
            overlap.run(p.parse_args(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_transfer_demo_needs_a_gpu():
    p = argparse.ArgumentParser()
    overlap.add_arguments(p)
    with pytest.raises(RuntimeError, match="CUDA GPU"):
        overlap.run(p.parse_args([]))


def test_table_with_gemm_columns():
    row = bench.Row("all_gather", 1 << 20, 1 << 18, "float32", 100.0, 10.49, 5.24, 2, "ce", True,
                    gemm_alone_tflops=660.0, gemm_during_tflops=653.4, gemm_slowdown_pct=1.0, gemm_cover=0.995)
    text = bench.format_table([row])
    assert "slowdown%" in text and "cover%" in text
    assert text.splitlines()[2].split()[-4:] == ["660.0", "653.4", "1.00", "99.5"]
    plain = bench.format_table([bench.Row("all_gather", 1024, 256, "float32", 1.0, 1.0, 0.5, 2, "mpi", True)])
    assert "gemm" not in plain


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transfer_demo_on_gpu(capsys):
    p = argparse.ArgumentParser()
    overlap.add_arguments(p)
    assert overlap.run(p.parse_args(["--transfer", "none,host,device", "--size", "16M", "--gemm-n", "1024",
                                     "--gemm-iters", "4", "--repeats", "1", "--json"])) == 0
    import json
    rows = {r["transfer"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"none", "host", "device"}
    assert rows["host"]["gemm_tflops"] > 0 and rows["host"]["transfer_gbs"] > 0 and rows["host"]["cover"] > 0


def test_gpu_check_commands_parse(monkeypatch):
    """gpu_check runs once on a GPU machine: every step's flags must be valid here."""
    from gemcore.comms import conformance, gpu_check

    monkeypatch.setattr(gpu_check, "_mpirun", lambda: "mpirun")
    seen = []
    monkeypatch.setattr(conformance, "_run_backend", lambda backend, args, dtypes, options: seen.append(options) or 0)
    all_steps = gpu_check.steps(quick=False)
    assert sum(limit for *_, limit in all_steps) < 600  # the whole check fits in ten minutes
    assert [name for name, *_ in gpu_check.steps(quick=True)] == ["overlap", "bench-flags", "bench-event"]
    for name, cmd, _ in all_steps:
        module = cmd[cmd.index("-m") + 1]
        argv = cmd[cmd.index("-m") + 2:]
        if module == "gemcore.comms.conformance":
            assert conformance.main(argv) == 0
        elif module == "gemcore.cli.main":
            p = argparse.ArgumentParser()
            bench.add_arguments(p)
            args = p.parse_args(argv[2:])
            assert args.overlap_gemm and args.backend == "ce"
        else:
            p = argparse.ArgumentParser()
            overlap.add_arguments(p)
            assert overlap.parse_transfers(p.parse_args(argv).transfer) == list(overlap.TRANSFERS)
    assert [o["sync"] for o in seen] == ["flags", "event", "flags", "barrier"]


def test_verdicts_compare_copy_engine_rows_with_the_goal():
    def host(during: float, noise: float) -> overlap.TransferRow:
        return overlap.TransferRow("host", during, overlap.slowdown_pct(660.0, during), 52.0, 0.99,
                                   noise_pct=noise, repeats=5)

    rows = [overlap.TransferRow("none", 660.0, 0.0, 0.0, 0.0),
            host(659.0, 0.3),
            overlap.TransferRow("peer", float("nan"), float("nan"), float("nan"), 0.0, "skipped: needs 2 GPUs"),
            overlap.TransferRow("device", 600.0, overlap.slowdown_pct(660.0, 600.0), 800.0, 1.0)]
    lines = overlap.verdicts(rows)
    assert len(lines) == 1 and "host" in lines[0] and "0.15%" in lines[0] and ": met;" in lines[0]
    rows[1] = host(640.0, 0.3)
    assert ": NOT met;" in overlap.verdicts(rows)[0]
    rows[1] = host(700.0, 0.5)  # -6 %: a speed-up beyond the noise is suspect, not "met"
    assert "no verdict" in overlap.verdicts(rows)[0] and "suspect" in overlap.verdicts(rows)[0]
    rows[1] = host(656.0, 3.0)  # noise above the goal: nothing can be concluded
    assert "no verdict" in overlap.verdicts(rows)[0]


@pytest.mark.parametrize("slowdown,noise,want", [
    (0.0, 0.2, "met"), (0.5, 0.4, "met"), (0.9, 0.4, "no verdict"), (2.0, 0.4, "NOT met"),
    (-0.1, 0.2, "met"), (-6.0, 0.5, "no verdict"), (-6.0, 7.0, "no verdict"), (0.0, 1.0, "no verdict"),
])
def test_slowdown_verdict_needs_the_noise_below_the_goal(slowdown, noise, want):
    assert overlap.slowdown_verdict(slowdown, noise, 1.0).startswith(want)


def test_noise_is_the_widest_relative_range():
    assert overlap.noise_pct([100.0, 101.0, 99.0], [50.0, 50.0]) == pytest.approx(2.0)
    assert overlap.median_spread([3.0, 1.0, 2.0]) == (2.0, 1.0, 3.0)
    with pytest.raises(ValueError):
        overlap.median_spread([])


# ---------------------------------------------------------------------- the SM-free profile's attribution
def _trace(launches: list[tuple[str, str, int, int]], marks: list[tuple[str, int, int]]) -> dict:
    """A chrome trace: ``marks`` (name, start, end) on thread 1; ``launches`` (runtime call, GPU
    category, GPU name, start) on thread 1, each with its GPU activity."""
    from gemcore.bench import comms_dist

    events = [{"ph": "X", "cat": "user_annotation", "name": {"x": comms_dist.EXCHANGE, "r": comms_dist.REDUCE}[n],
               "pid": 7, "tid": 1, "ts": a, "dur": b - a} for n, a, b in marks]
    for i, (call, cat, name, ts) in enumerate(launches):
        events.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": 7, "tid": 1, "ts": ts, "dur": 1,
                       "args": {"correlation": 100 + i}})
        events.append({"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": 9, "ts": ts + 5, "dur": 3,
                       "args": {"correlation": 100 + i}})
    events.append({"ph": "X", "cat": "kernel", "name": "fill", "pid": 0, "tid": 9, "ts": 1, "dur": 1,
                   "args": {"correlation": 999}})  # launched outside every mark
    return {"traceEvents": events}


def test_sm_free_attribution_and_verdict():
    from gemcore.bench import comms_dist

    launches = [("cudaMemcpyAsync", "gpu_memcpy", "Memcpy DtoD", 12), ("cudaMemcpyAsync", "gpu_memcpy", "Memcpy DtoD", 14),
                ("cudaLaunchKernel", "kernel", "reduce_kernel", 32), ("cudaLaunchKernel", "kernel", "sum", 50)]
    found = comms_dist.attribute(_trace(launches, [("x", 10, 20), ("r", 30, 40)]))
    assert found[comms_dist.EXCHANGE] == {"gpu_memcpy": 2}
    assert found[comms_dist.REDUCE] == {"kernel": 1}
    assert found["window"] == {"gpu_memcpy": 2, "kernel": 3}
    lines = comms_dist.verdict(found, reduce_kernels=1, what="all_gather")
    assert lines[0].startswith("PASS") and lines[1].startswith("PASS")
    assert comms_dist.verdict(found, reduce_kernels=2, what="x")[1].startswith("FAIL")
    # a kernel launched inside an exchange fails the check and is named
    launches.append(("cudaLaunchKernel", "kernel", "copy_kernel", 16))
    lines = comms_dist.verdict(comms_dist.attribute(_trace(launches, [("x", 10, 20), ("r", 30, 40)])), 1, "y")
    assert lines[0].startswith("FAIL") and "copy_kernel" in lines[0]
    # no memcpy seen inside the exchanges: the attribution saw nothing, which is no pass ...
    assert comms_dist.verdict(comms_dist.attribute(_trace([], [("x", 10, 20)])), 0, "z")[0].startswith("FAIL")
    # ... unless the window holds only ce work and its kernels are exactly the counted reductions
    unlinked = comms_dist.attribute(_trace([("cudaMemcpyAsync", "gpu_memcpy", "Memcpy DtoD", 12)], [("r", 30, 40)]))
    assert comms_dist.verdict(unlinked, 1, "u", only_ce=True)[0].startswith("PASS")  # the "fill" kernel
    assert comms_dist.verdict(unlinked, 0, "u", only_ce=True)[0].startswith("FAIL")
    assert comms_dist.verdict(unlinked, 1, "u", only_ce=False)[0].startswith("FAIL")


@pytest.mark.parametrize("argv,words", [
    (["--sm-free"], "--sm-free"), (["--anchor"], "--anchor"), (["--fsdp"], "--fsdp"), (["--in-place"], "--in-place"),
])
def test_profile_and_anchor_flags_need_cuda_or_each_other(argv, words):
    with pytest.raises(ValueError, match=words):
        bench.run(_parse(["--backend", "single", "--device", "cpu", *argv]))
