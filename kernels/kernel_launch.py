"""Launching an already compiled Triton / Gluon kernel without the JIT's per-call work.

``kernel[grid](*args, **meta)`` binds every argument, derives its specialisation (the binary a
call needs), hashes the options and looks the binary up each call. For a Gluon kernel that takes
TMA descriptors this includes printing each descriptor's shared-memory layout (the layout's repr
is part of its type). That is tens of µs of host time per launch: the attention's forward and
backward launch three kernels, and this work was most of their host time per call.

:class:`LaunchCache` keys the binary on what the specialisation depends on, computed directly:
each pointer's dtype and 16-byte alignment; each integer's equality to 1, divisibility by 16 and
32-bit range; each descriptor's dtype, block shape and layout object; the constexprs and options.
The first call of a key goes through ``kernel[grid]`` (which compiles or finds the binary); later
calls launch that binary through :meth:`triton.compiler.CompiledKernel.__getitem__` on the
current stream. The key is at least as fine as Triton's own specialisation (Triton's
``python/src/specialize.cc``), so a cached binary is only reused for arguments it was built for.
Under the interpreter (``TRITON_INTERPRET=1``) every call goes through ``kernel[grid]``.
"""
from __future__ import annotations

from typing import Any

import torch

#: the 32-bit range an integer argument must be in to keep an i32 binary
_I32 = (-(2**31), 2**31 - 1)


def current_device() -> int:
    """The current CUDA device's index (torch.cuda.current_device without its Python wrapper)."""
    return torch._C._cuda_getDevice()


def current_stream(device: int) -> int:
    """The current stream of ``device`` as a raw handle, as Triton's launcher takes it."""
    return torch._C._cuda_getCurrentRawStream(device)


def argument_key(arg: Any) -> Any:
    """What Triton's specialisation of one runtime argument depends on (never coarser)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return "u1"
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, _I32[0] <= arg <= _I32[1]
    if isinstance(arg, float):
        return "fp32"
    if arg is None:
        return None
    layout = getattr(arg, "layout", None)   # a TMA descriptor: its type is dtype, block, layout
    base = getattr(arg, "base", None)
    if base is not None and hasattr(arg, "block_shape"):
        return base.dtype, tuple(arg.block_shape), id(layout)
    raise TypeError(f"LaunchCache: no specialisation rule for a {type(arg).__name__} argument")


class LaunchCache:
    """The compiled binaries of one ``@triton.jit`` / ``@gluon.jit`` kernel by specialisation.

    ``launch(grid, args, meta, options)``: ``args`` are the kernel's runtime arguments in order,
    ``meta`` its constexprs by name (the parameters after ``args``), ``options`` the launch
    options (``num_warps``, ``maxnreg``, ...). Same effect as ``kernel[grid](*args, **meta,
    **options)``.
    """

    #: keys kept at most (a kernel whose calls keep changing specialisation starts over)
    max_binaries = 256

    def __init__(self, kernel):
        self.kernel = kernel
        self.binaries: dict[tuple, tuple[Any, tuple, tuple]] = {}
        #: launches that went straight to a kept binary
        self.replays = 0

    def launch(self, grid: tuple[int, ...], args: tuple, meta: dict[str, Any],
               options: dict[str, Any]) -> None:
        device = current_device()
        key = (device, tuple(meta.items()), tuple(options.items()), *map(argument_key, args))
        entry = self.binaries.get(key)
        if entry is not None:
            binary, tail, _layouts = entry
            binary[grid + (1,) * (3 - len(grid))](*args, *tail, stream=current_stream(device))
            self.replays += 1
            return
        binary = self.kernel[grid](*args, **meta, **options)
        names = self.kernel.arg_names
        if binary is None or not hasattr(binary, "__getitem__") or set(names[len(args):]) != set(meta):
            return  # the interpreter, or a call this cache cannot replay: keep the JIT path
        # the descriptors' layouts stay referenced, so that no other layout object takes their id
        layouts = tuple(getattr(a, "layout", None) for a in args)
        if len(self.binaries) >= self.max_binaries:
            self.binaries.clear()
        self.binaries[key] = (binary, tuple(meta[name] for name in names[len(args):]), layouts)
