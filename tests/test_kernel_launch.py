"""LaunchCache: the binary of a specialisation is reused only for arguments it was built for."""
from __future__ import annotations

import pytest
import torch

from gemcore.kernels import kernel_launch
from gemcore.kernels.kernel_launch import LaunchCache, argument_key


def test_the_key_separates_what_triton_specialises_on():
    aligned = torch.zeros(8, dtype=torch.float32)
    assert argument_key(aligned) == (torch.float32, True)
    assert argument_key(aligned[1:]) == (torch.float32, False)            # 4 bytes in: not 16-aligned
    assert argument_key(aligned.to(torch.bfloat16)) == (torch.bfloat16, True)
    assert argument_key(1) != argument_key(2) != argument_key(16)         # == 1, % 16, neither
    assert argument_key(17) == argument_key(3)
    assert argument_key(2**31) != argument_key(2**31 - 16)                # i64 against i32
    assert argument_key(True) == "u1" and argument_key(0.5) == "fp32" and argument_key(None) is None
    with pytest.raises(TypeError, match="no specialisation rule for a str"):
        argument_key("x")


class _Binary:
    """A compiled kernel's stand-in: records the launches it runs."""

    def __init__(self, log):
        self.log = log

    def __getitem__(self, grid):
        return lambda *args, stream: self.log.append(("binary", grid, args, stream))


class _Kernel:
    """A JIT kernel's stand-in with runtime args (x, n) and constexprs (BLOCK, EVEN)."""

    arg_names = ["x", "n", "BLOCK", "EVEN"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.log.append(("jit", grid, args, kwargs))
            return _Binary(self.log)
        return run


def test_a_key_goes_through_the_jit_once_then_straight_to_its_binary(monkeypatch):
    monkeypatch.setattr(kernel_launch, "current_device", lambda: 0)
    monkeypatch.setattr(kernel_launch, "current_stream", lambda device: 7)
    kernel = _Kernel()
    cache = LaunchCache(kernel)
    x = torch.zeros(64)
    meta, options = dict(BLOCK=32, EVEN=True), dict(num_warps=4)
    cache.launch((2,), (x, 48), meta, options)
    cache.launch((3,), (x, 64), meta, options)                # same key: 48 and 64 are both % 16
    assert [entry[0] for entry in kernel.log] == ["jit", "binary"]
    assert kernel.log[0] == ("jit", (2,), (x, 48), dict(BLOCK=32, EVEN=True, num_warps=4))
    assert kernel.log[1] == ("binary", (3, 1, 1), (x, 64, 32, True), 7)  # constexprs in parameter order
    cache.launch((3,), (x, 47), meta, options)                # 47: another specialisation
    cache.launch((3,), (x[1:], 64), meta, options)            # unaligned pointer
    cache.launch((3,), (x, 64), dict(BLOCK=64, EVEN=True), options)
    cache.launch((3,), (x, 64), meta, dict(num_warps=8))
    assert [entry[0] for entry in kernel.log[2:]] == ["jit"] * 4
    assert cache.replays == 1 and len(cache.binaries) == 5


def test_the_interpreter_path_is_never_kept(monkeypatch):
    monkeypatch.setattr(kernel_launch, "current_device", lambda: 0)

    class Interpreted(_Kernel):
        def __getitem__(self, grid):
            return lambda *args, **kwargs: self.log.append("run")  # returns None, as the interpreter

    kernel = Interpreted()
    cache = LaunchCache(kernel)
    for _ in range(3):
        cache.launch((1,), (torch.zeros(4), 4), dict(BLOCK=4, EVEN=True), {})
    assert kernel.log == ["run"] * 3 and not cache.binaries


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (launches a compiled kernel)")
def test_kept_binaries_compute_what_the_jit_launch_computes():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_add(x, y, n, alpha, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y + i, tl.load(x + i, mask=i < n) * alpha + 1.0, mask=i < n)

    cache = LaunchCache(scale_add)
    base = torch.randn(4099, device="cuda")
    for n, start in [(1, 0), (16, 0), (17, 0), (4096, 0), (4096, 1), (4095, 3), (16, 0), (4096, 1)]:
        x = base[start:start + n]
        y = torch.empty_like(x)
        cache.launch((triton.cdiv(n, 256),), (x, y, n, 0.5), dict(BLOCK=256), dict(num_warps=4))
        torch.testing.assert_close(y, x * 0.5 + 1.0, rtol=0, atol=0)
    assert cache.replays == 3  # (4096, 0) reuses (16, 0)'s binary; (16, 0) and (4096, 1) their own
