"""tools/kernel_resources.py: kernels built for sm_90 on any machine, their registers and spills
read from the cubin; bad arguments named."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "kernel_resources.py"
pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="builds the kernels: not under the interpreter")


def _tool():
    spec = importlib.util.spec_from_file_location("kernel_resources", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks its module up there)
    spec.loader.exec_module(module)
    return module


def _has_cuobjdump(tool) -> bool:
    try:
        tool.cuobjdump()
        return True
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("name,warps", [("fp8_cast_rows", None), ("swiglu_bwd", 16)])
def test_a_kernel_built_for_hopper_reports_its_registers(name, warps):
    tool = _tool()
    if not _has_cuobjdump(tool):
        pytest.skip("this triton has no NVIDIA cuobjdump")
    r = tool.measure(name, 90, warps)
    assert r.kernel == name and r.warps == (warps or 4)
    # a thread gets at most 65,536 / (32 x warps) registers (and never more than 255)
    assert 16 <= r.registers <= min(255, 65536 // (32 * r.warps)) and r.stack_bytes >= 0 and r.shared_bytes >= 0


def test_unknown_kernel_is_named():
    with pytest.raises(ValueError, match="kernel must be one of fp8_cast_rows, .* got 'gemm'"):
        _tool().measure("gemm")


@pytest.mark.parametrize("args,message", [(("--kernels", "gemm"), "--kernels: unknown gemm"),
                                          (("--warps", "eight"), "--warps must be a comma list of integers"),
                                          (("--warps", "6"), "--warps: each count must be a power of two")])
def test_bad_arguments_are_named(args, message):
    run = subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and message in run.stderr
