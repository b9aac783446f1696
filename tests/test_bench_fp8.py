"""The arithmetic of the block-scaled FP8 rows of ``gem bench mx`` (no GPU needed: the timing is
replaced by fixed milliseconds)."""
import pytest

from gemcore.bench import fp8


def test_rate_units():
    # 402,653,184 bytes (a 24576x4096 bf16 copy: read and write) in 0.136 ms: 2.96 TB/s
    assert fp8.rate(4.0 * 24576 * 4096, 0.136, "GB/s") == pytest.approx(2960.7, abs=0.1)
    # 2 * 8192^3 FLOPs in 1.515 ms: 726 TFLOP/s
    assert fp8.rate(2.0 * 8192**3, 1.515, "TFLOP/s") == pytest.approx(725.7, abs=0.1)
    assert fp8.rate(1e6, 1.0, "GB/s") == 1.0 and fp8.rate(1e9, 1.0, "TFLOP/s") == 1.0
    with pytest.raises(ValueError, match="unit must be one of"):
        fp8.rate(1.0, 1.0, "GiB/s")


def test_row_rates_and_note(monkeypatch):
    monkeypatch.setattr(fp8, "_times", lambda fn: (0.5, 1.0))  # GPU-only ms, host-included ms
    row = fp8._row("cast", "x", lambda: None, 3e9, "GB/s", anchor=3000.0, check=lambda: "bit-exact")
    assert row.ms == 0.5 and row.rate == pytest.approx(6000.0) and row.vs_anchor == pytest.approx(2.0)
    assert row.note == "host incl. 1.000 ms = 3000 GB/s; bit-exact"
    row = fp8._row("gemm", "y", lambda: None, 2e12, "TFLOP/s")
    assert row.rate == pytest.approx(4000.0) and row.vs_anchor is None
    assert row.note == "host incl. 1.000 ms = 2000 TFLOP/s"
