"""The ce backend's stream-memory-operation wrapper against a stand-in driver library (no GPU)."""
from __future__ import annotations

import ctypes
import threading

import pytest

from gemcore.comms import ce_flags


class FakeFn:
    def __init__(self, log: list, name: str, code: int = 0) -> None:
        self.log, self.name, self.code = log, name, code

    def __call__(self, *args):
        self.log.append((self.name, *args))
        return self.code


class FakeLib:
    def __init__(self, code: int = 0, v2: bool = True) -> None:
        self.log: list = []
        suffix = "_v2" if v2 else ""
        setattr(self, f"cuStreamWriteValue32{suffix}", FakeFn(self.log, "write", code))
        setattr(self, f"cuStreamWaitValue32{suffix}", FakeFn(self.log, "wait", code))

    def cuGetErrorName(self, code, out):  # noqa: N802 (the driver's name)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_char_p))[0] = b"CUDA_ERROR_NOT_SUPPORTED"
        return 0


@pytest.fixture
def lib(monkeypatch):
    made = {}

    def load(name):
        assert name == "libcuda.so.1"
        return made.setdefault("lib", FakeLib())

    monkeypatch.setattr(ce_flags.ctypes, "CDLL", load)
    return made


def test_write_and_wait_pass_stream_address_value_and_flags(lib):
    binds = []
    flags = ce_flags.StreamFlags(bind=lambda: binds.append(threading.get_ident()))
    flags.write(7, 0x1000, 3)
    flags.wait_geq(7, 0x2000, (1 << 32) + 5)  # counters wrap: the driver compares cyclically
    assert lib["lib"].log == [("write", 7, 0x1000, 3, 0), ("wait", 7, 0x2000, 5, 0)]
    other = threading.Thread(target=lambda: flags.write(8, 0x1000, 4))
    other.start()
    other.join()
    assert len(binds) == 2 and binds[0] != binds[1]  # the context is bound once per thread


def test_v1_names_are_used_when_v2_is_missing(monkeypatch):
    fake = FakeLib(v2=False)
    monkeypatch.setattr(ce_flags.ctypes, "CDLL", lambda name: fake)
    ce_flags.StreamFlags(bind=lambda: None).write(0, 4, 1)
    assert fake.log == [("write", 0, 4, 1, 0)]


def test_a_driver_error_is_named(monkeypatch):
    fake = FakeLib(code=801)
    monkeypatch.setattr(ce_flags.ctypes, "CDLL", lambda name: fake)
    with pytest.raises(RuntimeError, match="cuStreamWaitValue32 failed with CUDA_ERROR_NOT_SUPPORTED"):
        ce_flags.StreamFlags(bind=lambda: None).wait_geq(0, 4, 1)


def test_no_driver_library_says_why(monkeypatch):
    def missing(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ce_flags.ctypes, "CDLL", missing)
    with pytest.raises(RuntimeError, match="libcuda.so.1.*sync='event'"):
        ce_flags.StreamFlags(bind=lambda: None)
