"""The benchmark's flags and the --overlap-gemm / one-GPU transfer demo arithmetic, on CPU
(the GPU measurement itself runs on the device machine; see docs/comms.md)."""
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
    # 40 GEMMs of 8192^3 in 66.2 ms is about 664 TFLOP/s (ANCHORS.md's bf16 GEMM figure)
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
    """The lead runs gpu_check once on the GPU machine: every step's flags must be valid here."""
    from gemcore.comms import conformance, gpu_check

    monkeypatch.setattr(gpu_check, "_mpirun", lambda: "mpirun")
    seen = []
    monkeypatch.setattr(conformance, "_run_backend", lambda backend, args, dtypes, options: seen.append(options) or 0)
    all_steps = gpu_check.steps(quick=False)
    assert sum(limit for *_, limit in all_steps) < 600  # the device machine's limit per command
    assert [name for name, *_ in gpu_check.steps(quick=True)] == ["overlap", "bench-barrier", "bench-event"]
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
    assert [o["sync"] for o in seen] == ["barrier", "event", "event", "barrier"]


def test_verdicts_compare_copy_engine_rows_with_the_goal():
    rows = [overlap.TransferRow("none", 660.0, 0.0, 0.0, 0.0),
            overlap.TransferRow("host", 656.0, overlap.slowdown_pct(660.0, 656.0), 52.0, 0.99),
            overlap.TransferRow("peer", float("nan"), float("nan"), float("nan"), 0.0, "skipped: needs 2 GPUs"),
            overlap.TransferRow("device", 600.0, overlap.slowdown_pct(660.0, 600.0), 800.0, 1.0)]
    lines = overlap.verdicts(rows)
    assert len(lines) == 1 and "host" in lines[0] and "0.61%" in lines[0] and ": met" in lines[0]
    rows[1] = overlap.TransferRow("host", 640.0, overlap.slowdown_pct(660.0, 640.0), 52.0, 0.99)
    assert "NOT met" in overlap.verdicts(rows)[0]
