"""GPU-side flags for the ``ce`` backend: CUDA stream memory operations through the driver API.

``cuStreamWriteValue32`` queues a 32-bit write on a stream (after the stream's earlier work, behind
a memory fence); ``cuStreamWaitValue32`` with ``CU_STREAM_WAIT_VALUE_GEQ`` makes a stream wait
until a word holds at least a value (a cyclic comparison, so counters may wrap). The word may be
device memory of another process opened through CUDA IPC, so one process's stream can wait for
another's with no host involvement (CUDA Driver API, "Stream Memory Operations"). CuPy does not
wrap these calls; they are called from ``libcuda`` with ctypes on the caller's CUDA stream handles.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_WRITE_DEFAULT = 0x0  # CU_STREAM_WRITE_VALUE_DEFAULT: a memory fence before the write
_SIGNATURE = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]


def _symbol(lib, *names: str):
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.restype, fn.argtypes = ctypes.c_int, _SIGNATURE
            return fn
    raise RuntimeError(f"backend 'ce' (sync='flags'): the CUDA driver has none of {', '.join(names)}; "
                       f"use sync='event'")


class StreamFlags:
    """``write(stream, addr, value)`` and ``wait_geq(stream, addr, value)`` on raw CUDA streams
    (``torch.cuda.Stream.cuda_stream``) and device addresses of 32-bit words.

    :param bind: makes the device's primary context current on the calling thread (driver calls
        need one; called once per thread, e.g. on autograd's backward thread).
    """

    def __init__(self, bind: Callable[[], None]) -> None:
        self._bind, self._bound = bind, threading.local()
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise RuntimeError(f"backend 'ce' (sync='flags') needs the CUDA driver library libcuda.so.1 "
                               f"({exc}); use sync='event'") from exc
        self._write = _symbol(self.lib, "cuStreamWriteValue32_v2", "cuStreamWriteValue32")
        self._wait = _symbol(self.lib, "cuStreamWaitValue32_v2", "cuStreamWaitValue32")

    def _check(self, code: int, what: str) -> None:
        if code:
            name = ctypes.c_char_p()
            self.lib.cuGetErrorName(code, ctypes.byref(name))
            raise RuntimeError(f"backend 'ce': {what} failed with {(name.value or b'?').decode()} ({code})")

    def _context(self) -> None:
        if not getattr(self._bound, "done", False):
            self._bind()
            self._bound.done = True

    def write(self, stream: int, addr: int, value: int) -> None:
        """Queue ``*addr = value`` on ``stream`` (after the stream's earlier work)."""
        self._context()
        self._check(self._write(stream, addr, value & 0xFFFFFFFF, _WRITE_DEFAULT), "cuStreamWriteValue32")

    def wait_geq(self, stream: int, addr: int, value: int) -> None:
        """Queue on ``stream``: wait until ``(int32)(*addr - value) >= 0``."""
        self._context()
        self._check(self._wait(stream, addr, value & 0xFFFFFFFF, _WAIT_GEQ), "cuStreamWaitValue32")
