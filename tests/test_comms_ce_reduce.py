"""The ce backend's one SM step, the reduction of pulled chunks, on CPU against float64 references;
and its public boundary (CUDA tensors only) without a GPU."""
from __future__ import annotations

import pytest
import torch

from gemcore.comms.ce_backend import CopyEngineCommunicator, reduce_chunks

FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
INTS = [torch.int64, torch.int32, torch.int8, torch.uint8]


def _stage(w: int, m: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(w, m, generator=g) * 3).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (w, m), generator=g).to(dtype)


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("w,m", [(1, 5), (2, 0), (2, 1), (3, 17), (4, 1000)])
def test_float_reduction_rounds_once(dtype, op, w, m):
    """16-bit floats: accumulated in float32 (exact for these sums of w values up to rounding of
    float32), rounded once to the dtype, as NCCL does; the rest: in their own type."""
    stage = _stage(w, m, dtype, seed=w * 100 + m)
    out = torch.empty(m, dtype=dtype)
    kernels = reduce_chunks(stage, out, op)
    ref = stage.double()
    want = {"sum": ref.sum(0), "avg": ref.sum(0) / w, "max": ref.amax(0) if m else ref.sum(0),
            "min": ref.amin(0) if m else ref.sum(0)}[op].to(dtype)
    tol = {torch.float32: 1e-6, torch.float64: 1e-12}.get(dtype, 0.0)
    if dtype in (torch.bfloat16, torch.float16) and op in ("sum", "avg"):
        # rounding the float64 value once may differ from rounding the float32 accumulation by
        # one ulp only where the float32 sum itself was inexact; compare with that reference
        acc = stage.float().sum(0)
        want = (acc if op == "sum" else acc / w).to(dtype)
    assert torch.allclose(out.double(), want.double(), rtol=tol, atol=tol), (out[:6], want[:6])
    assert kernels == (2 if op == "avg" else 1)


@pytest.mark.parametrize("dtype,op", [(dtype, op) for dtype in FLOATS + INTS[:2]
                                      for op in ("sum", "avg", "max", "min")
                                      if op != "avg" or dtype.is_floating_point])  # avg: floats only
@pytest.mark.parametrize("w,m", [(1, 5), (2, 0), (2, 1), (2, 33), (3, 17), (4, 1000)])
@pytest.mark.parametrize("into_row", [None, 0, -1])
def test_rows_read_in_place_reduce_like_the_stage(dtype, op, w, m, into_row):
    """The direct form (separate rows, as read from the peers' windows; the output may be one of
    them, as an in-place all_reduce makes it): the same values as the staged reduction, within
    one rounding of the dtype; integers and max/min exactly; 16-bit floats accumulate in float32."""
    stage = _stage(w, m, dtype, seed=w * 10 + m)
    rows = [r.clone() for r in stage]
    out = torch.empty(m, dtype=dtype) if into_row is None else rows[into_row]
    kernels = reduce_chunks(rows, out, op)
    want = torch.empty(m, dtype=dtype)
    reduce_chunks(stage, want, op)
    if dtype in (torch.float32, torch.float64) and op in ("sum", "avg"):
        tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
        assert torch.allclose(out.double(), want.double(), rtol=tol, atol=tol)
    else:  # bit for bit: integers, max/min, and 16-bit floats (one float32 accumulation, one rounding)
        assert torch.equal(out, want), (out[:6], want[:6])
    assert kernels == 1 if w == 1 else kernels <= w + 2


def test_bf16_sum_is_not_a_bf16_running_sum():
    """A running bf16 sum loses the small terms; the reduction keeps them (float32 accumulation)."""
    stage = torch.tensor([[256.0], [1.0], [1.0], [1.0]], dtype=torch.bfloat16)
    out = torch.empty(1, dtype=torch.bfloat16)
    reduce_chunks(stage, out, "sum")
    rows_out = torch.empty(1, dtype=torch.bfloat16)
    reduce_chunks(list(stage), rows_out, "sum")
    assert rows_out.item() == 260.0
    running = stage[0]
    for row in stage[1:]:
        running = running + row
    assert out.item() == 260.0 and running.item() == 256.0


@pytest.mark.parametrize("dtype", INTS)
@pytest.mark.parametrize("op", ["sum", "max", "min"])
def test_integer_reduction_wraps_in_its_type(dtype, op):
    stage = _stage(3, 50, dtype, seed=7)
    out = torch.empty(50, dtype=dtype)
    reduce_chunks(stage, out, op)
    ref = stage.long()
    want = {"sum": ref.sum(0), "max": ref.amax(0), "min": ref.amin(0)}[op].to(dtype)  # .to wraps
    assert torch.equal(out, want)


class _NoGpuCE(CopyEngineCommunicator):
    """Only the public boundary (no CUDA, no CuPy, no peers)."""

    def __init__(self) -> None:  # noqa: D107 (bypasses the CUDA set-up)
        from gemcore.comms.base import Communicator
        Communicator.__init__(self, timeout_s=None, check=False)


@pytest.mark.parametrize("call", [
    lambda c, x: c.all_gather(x), lambda c, x: c.reduce_scatter(x), lambda c, x: c.all_reduce(x),
    lambda c, x: c.all_to_all(x), lambda c, x: c.broadcast(x), lambda c, x: c.all_gather_into(x, x),
    lambda c, x: c.reduce_scatter_into(x, x), lambda c, x: c.send(x, 1), lambda c, x: c.recv(x, 1),
])
def test_cpu_tensors_are_refused_naming_device_and_backend(call):
    with pytest.raises(ValueError, match=r"backend 'ce' serves CUDA tensors .* on cpu"):
        call(_NoGpuCE(), torch.zeros(2))


def test_without_cuda_the_error_says_why():
    if torch.cuda.is_available():
        pytest.skip("CUDA is present")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        CopyEngineCommunicator()


def test_no_host_synchronisation_on_the_hot_path():
    """The host waits for the GPU only where the window grows, at set-up and finalize, and in the
    host-staged fallbacks; every collective path only enqueues."""
    import ast
    import inspect

    from gemcore.comms import ce_backend

    tree = ast.parse(inspect.getsource(ce_backend.CopyEngineCommunicator))
    syncing = {"synchronize", "cpu", "item", "deviceSynchronize", "streamSynchronize"}
    found = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef):
            calls = {n.func.attr for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
            if calls & syncing:
                found[fn.name] = sorted(calls & syncing)
    assert set(found) == {"_grow", "_open_flags", "_finalize_impl", "_via_host"}, found


def test_a_cuda_ipc_failure_says_why():
    class Runtime:
        def ipcGetMemHandle(self, ptr):  # noqa: N802 (CUDA's name)
            raise OSError("cudaErrorNotSupported: operation not supported")

    c = _NoGpuCE()
    c.rt = Runtime()
    with pytest.raises(RuntimeError, match=r"needs CUDA IPC .* ipcGetMemHandle failed on rank 0 .*not supported"):
        c._ipc("ipcGetMemHandle", 1234)
