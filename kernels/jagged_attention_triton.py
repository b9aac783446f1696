"""Jagged attention on Triton: launchers, the torch custom ops and their autograd.

The kernels live in ``jagged_attention_triton_fwd`` / ``_bwd`` (shared pieces in ``_common``).
The forward and the backward are registered as torch.library custom ops (``gemcore::jagged_attention_fwd`` /
``gemcore::jagged_attention_bwd``) with fake implementations, so a model calling them compiles
under torch.compile without graph breaks. Data-dependent checks (offsets' values, num_targets,
max_seqlen) run inside the forward op, so they are not traced.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from gemcore.kernels.jagged_attention_checks import check_values
from gemcore.kernels.jagged_attention_reference import window_bounds
from gemcore.kernels.jagged_attention_triton_bwd import _jagged_attn_bwd_dkdv, _jagged_attn_bwd_dq
from gemcore.kernels.jagged_attention_triton_common import ACTIVATION_CODES
from gemcore.kernels.jagged_attention_triton_fwd import _jagged_attn_fwd


@dataclass(frozen=True)
class TileConfig:
    """Tile shape and launch parameters of one kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: (kernel, head-dim bucket) -> TileConfig; D=128 rows picked by `gem bench attention --tune` on an
#: H200 in bf16 (docs/kernels.md); the others are untuned guesses.
CONFIGS: dict[tuple[str, int], TileConfig] = {
    ("fwd", 64): TileConfig(128, 64, 4, 3),
    ("fwd", 128): TileConfig(128, 32, 4, 4),
    ("fwd", 256): TileConfig(64, 32, 4, 2),
    ("dkdv", 64): TileConfig(64, 128, 8, 3),
    ("dkdv", 128): TileConfig(64, 128, 8, 2),
    ("dkdv", 256): TileConfig(32, 64, 4, 2),
    ("dq", 64): TileConfig(128, 64, 8, 3),
    ("dq", 128): TileConfig(128, 64, 8, 3),
    ("dq", 256): TileConfig(64, 32, 4, 2),
}

#: (kernel, head-dim bucket) -> TileConfig for the pointwise activations (silu, gelu, ...) where
#: their best tile differs from softmax's (no running max/sum, other registers); else CONFIGS
#: dK/dV D=128: 3 stages instead of 2, from `gem bench attention --tune --activation silu` on the H200
#: (2026-12-03): +8.5 % forward+backward on dense95 and +8.7 % on heavytail in the same
#: process; softmax's own tune gave +1.5 % for the same change, within the drift, so softmax keeps 2
POINTWISE_CONFIGS: dict[tuple[str, int], TileConfig] = {
    ("dkdv", 128): TileConfig(64, 128, 8, 3),
}

_pinned: dict[str, TileConfig] = {}


@contextlib.contextmanager
def pinned_configs(**configs: TileConfig):
    """Force tile configs (``fwd=``, ``dkdv=``, ``dq=``) inside the block: tests and tuning."""
    old = dict(_pinned)
    _pinned.update(configs)
    try:
        yield
    finally:
        _pinned.clear()
        _pinned.update(old)


def head_dim_bucket(head_dim: int) -> int:
    """The CONFIGS bucket of a head dim: 64, 128 or 256."""
    return 64 if head_dim <= 64 else 128 if head_dim <= 128 else 256


def _config(kernel: str, head_dim: int, dtype: torch.dtype, max_rows: int,
            activation: str = "softmax") -> TileConfig:
    """The tile of ``kernel`` for this head dim, dtype and activation, its query tile fitted to
    ``max_rows`` (the longest query run)."""
    if kernel in _pinned:
        return _pinned[kernel]
    key = (kernel, head_dim_bucket(head_dim))
    cfg = POINTWISE_CONFIGS.get(key, CONFIGS[key]) if activation != "softmax" else CONFIGS[key]
    if dtype == torch.float32:  # fp32 tiles take twice the shared memory
        cfg = TileConfig(max(16, cfg.block_m // 2), max(16, cfg.block_n // 2), cfg.num_warps,
                         min(cfg.num_stages, 2))
    return _fit_rows(cfg, max_rows)


def _fit_rows(cfg: TileConfig, max_rows: int) -> TileConfig:
    """``cfg`` with its query tile cut down to the longest query run (pooled attention with a
    few queries, short sequences): no 128-row tiles for 16 rows. Pinned configs are kept."""
    block_m = max(16, min(cfg.block_m, _next_pow2(max(1, max_rows))))
    if block_m == cfg.block_m:
        return cfg
    return TileConfig(block_m, cfg.block_n, min(cfg.num_warps, 4), cfg.num_stages)


# plain-int twins of triton.cdiv / triton.next_power_of_2, which are constexpr functions in recent
# Triton and cost microseconds of host time per call
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The smallest power of two >= n (n >= 1)."""
    return 1 << (n - 1).bit_length()


def _block_d(d: int) -> int:
    return max(16, _next_pow2(d))


def _fast_act(q: torch.Tensor, activation: str) -> bool:
    """Hardware tanh for the sigmoid of silu / gelu_tanh: 16-bit inputs on a GPU only (its
    ~2^-11 absolute error is below bf16 / fp16 rounding of the activations, not below fp32's;
    the interpreter cannot run inline PTX)."""
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)
            and activation in ("silu", "gelu_tanh"))


def _common(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
            window_left, window_right, max_seqlen):
    """Launch arguments shared by the three kernels."""
    pooled = offsets is None
    kv_off = _int64(offsets if kv_offsets is None else kv_offsets)
    q_off = kv_off if pooled else _int64(offsets)
    B = kv_off.numel() - 1
    H = q.shape[1]
    nq_pooled = q.shape[0] if pooled else 0
    inv_norm = _inv_norm(activation, norm, max_seqlen)
    nt = _int64(num_targets) if num_targets is not None else kv_off
    flags = dict(
        D_QK=q.shape[2], D_V=v.shape[2], BLOCK_DQK=_block_d(q.shape[2]), BLOCK_DV=_block_d(v.shape[2]),
        ACTIVATION=ACTIVATION_CODES[activation], CAUSAL=bool(causal),
        HAS_TARGETS=num_targets is not None, HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0,
        POOLED=pooled, INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FAST_ACT=_fast_act(q, activation),
    )
    max_q = nq_pooled if pooled else max_seqlen
    return q_off, kv_off, nt, B, H, nq_pooled, inv_norm, flags, max_q


#: the switches that turn the Gluon (Hopper) kernels off: both parts, the backward alone
GLUON_SWITCH, GLUON_BWD_SWITCH = "GEMCORE_GLUON_ATTENTION", "GEMCORE_GLUON_ATTENTION_BWD"


def _gluon_off(part: str) -> bool:
    """Whether the user turned the Gluon ``part`` ("forward" / "backward") off by its switch."""
    names = (GLUON_SWITCH,) if part == "forward" else (GLUON_SWITCH, GLUON_BWD_SWITCH)
    return any(os.environ.get(name, "1") == "0" for name in names)


@functools.lru_cache(maxsize=1)
def _hopper_modules():
    """(jagged_attention_gluon, jagged_attention_gluon_bwd).

    :raises RuntimeError: they do not load with the installed Triton, naming the error and the
        switch that runs the Triton kernels instead.
    """
    try:
        from gemcore.kernels import jagged_attention_gluon, jagged_attention_gluon_bwd
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"gemcore: the Gluon (Hopper) attention kernels do not load with triton {triton.__version__} "
            f"({type(exc).__name__}: {exc}); set {GLUON_SWITCH}=0 to run the Triton kernels instead") from exc
    return jagged_attention_gluon, jagged_attention_gluon_bwd


def forward_kernel(q, k, v, offsets, kv_offsets=None, num_targets=None, causal: bool = True,
                   window_left: int = -1, window_right: int = -1, activation: str = "softmax") -> str:
    """Which forward the Triton backend runs on these inputs: "gluon-hopper" or "triton"."""
    modules = _hopper_modules() if q.is_cuda and not _gluon_off("forward") else None
    if modules is not None and modules[0].gluon_forward_applies(
            q, k, v, offsets, kv_offsets, num_targets, causal, window_left, window_right, activation):
        return "gluon-hopper"
    return "triton"


def backward_kernel(q, k, v, offsets, kv_offsets=None, num_targets=None, causal: bool = True,
                    window_left: int = -1, window_right: int = -1) -> str:
    """Which backward the Triton backend runs on these inputs: "gluon-hopper" or "triton"."""
    modules = _hopper_modules() if q.is_cuda and not _gluon_off("backward") else None
    if modules is not None and modules[1].gluon_backward_applies(
            q, k, v, offsets, kv_offsets, num_targets, causal, window_left, window_right):
        return "gluon-hopper"
    return "triton"


def _run_hopper(part: str, *args, **kwargs):
    """The Gluon ``part``'s result ("forward": (out, lse2); "backward": (dq, dk, dv)).

    :raises RuntimeError: it failed to build on this Triton or GPU (a Gluon API this code does not
        know, too little shared memory), naming the error and the switch that runs the Triton
        kernels instead; the Triton kernels never replace it unasked.
    """
    fwd_module, bwd_module = _hopper_modules()
    try:
        if part == "forward":
            return fwd_module.jagged_attention_fwd_hopper(*args, **kwargs)
        return bwd_module.jagged_attention_bwd_hopper(*args, **kwargs)
    except (CompilationError, OutOfResources) as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else ""
        switch = f"{GLUON_SWITCH}=0" if part == "forward" else f"{GLUON_BWD_SWITCH}=0 (the backward alone)"
        raise RuntimeError(
            f"gemcore: the Gluon (Hopper) attention {part} failed to build here ({type(exc).__name__}: "
            f"{first_line}); set {switch} to run the Triton {part} instead") from exc


def _int64(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.dtype == torch.int64 else t.to(torch.int64)


def _inv_norm(activation: str, norm: float, max_seqlen: int) -> float:
    """The factor of a pointwise activation's sum (1 for softmax)."""
    if activation == "softmax":
        return 1.0
    return 1.0 / (norm if norm > 0 else max(max_seqlen, 1))


def _fwd(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
         window_left, window_right, max_seqlen):
    if forward_kernel(q, k, v, offsets, kv_offsets, num_targets, causal, window_left, window_right,
                      activation) == "gluon-hopper":
        return _run_hopper("forward", q, k, v, _int64(offsets), activation, causal, scale,
                           _inv_norm(activation, norm, max_seqlen), max_seqlen, _int64(num_targets),
                           kv_offsets=_int64(kv_offsets))
    q_off, kv_off, nt, B, H, nq_pooled, inv_norm, flags, max_q = _common(
        q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm, window_left,
        window_right, max_seqlen)
    rows = B * nq_pooled if offsets is None else q.shape[0]
    out = q.new_empty(rows, H, v.shape[2])
    lse2 = torch.empty(rows if activation == "softmax" else 0, H, device=q.device,
                       dtype=torch.float32)
    cfg = _config("fwd", max(q.shape[2], v.shape[2]), q.dtype, max_q, activation)
    n_m_tiles = _cdiv(max_q, cfg.block_m)
    if B * H > 0 and n_m_tiles > 0:
        _jagged_attn_fwd[(B * H, n_m_tiles)](
            q, k, v, out, lse2, q_off, kv_off, nt,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1),
            H, nq_pooled, n_m_tiles, scale, inv_norm, window_left, window_right,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags)
    return out, lse2


def _bwd(do, q, k, v, out, lse2, offsets, kv_offsets, num_targets, activation, causal, scale,
         norm, window_left, window_right, max_seqlen):
    do = do.reshape(-1, q.shape[1], v.shape[2])
    if backward_kernel(q, k, v, offsets, kv_offsets, num_targets, causal, window_left,
                       window_right) == "gluon-hopper":
        return _run_hopper("backward", do, q, k, v, out, lse2, _int64(offsets), activation, causal, scale,
                           _inv_norm(activation, norm, max_seqlen), max_seqlen, _int64(num_targets))
    q_off, kv_off, nt, B, H, nq_pooled, inv_norm, flags, max_q = _common(
        q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm, window_left,
        window_right, max_seqlen)
    if do.stride(-1) != 1:
        do = do.contiguous()
    # softmax: delta = rowsum(dO * O) is written by the dQ kernel, which therefore runs first
    delta = torch.empty(lse2.shape, device=q.device, dtype=torch.float32)
    dq_rows = torch.empty(do.shape[0], H, q.shape[2], device=q.device,
                          dtype=torch.float32 if offsets is None else q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    cfg = _config("dq", max(q.shape[2], v.shape[2]), q.dtype, max_q, activation)
    n_m_tiles = _cdiv(max_q, cfg.block_m)
    if B * H > 0 and n_m_tiles > 0:
        _jagged_attn_bwd_dq[(B * H, n_m_tiles)](
            q, k, v, out, do, lse2, delta, dq_rows, q_off, kv_off, nt,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), do.stride(0), do.stride(1),
            dq_rows.stride(0), dq_rows.stride(1),
            H, nq_pooled, n_m_tiles, scale, inv_norm, window_left, window_right,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags)
    cfg = _config("dkdv", max(q.shape[2], v.shape[2]), q.dtype, max_q, activation)
    n_n_tiles = _cdiv(max_seqlen, cfg.block_n)
    if B * H > 0 and n_n_tiles > 0:
        _jagged_attn_bwd_dkdv[(B * H, n_n_tiles)](
            q, k, v, do, lse2, delta, dk, dv, q_off, kv_off, nt,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            do.stride(0), do.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            H, nq_pooled, scale, inv_norm, window_left, window_right,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages, **flags)
    if offsets is None:  # pooled: every sequence's queries are the same rows of q
        dq = dq_rows.view(B, q.shape[0], H, q.shape[2]).sum(0).to(q.dtype)
    else:
        dq = dq_rows
    return dq, dk, dv


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("gemcore::jagged_attention_fwd", mutates_args=())
def jagged_attention_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: Optional[torch.Tensor],
    kv_offsets: Optional[torch.Tensor], num_targets: Optional[torch.Tensor], activation: str,
    causal: bool, scale: float, norm: float, window_left: int, window_right: int,
    max_seqlen: int, validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (out, lse2, max_seqlen as a 0-d int64 tensor, resolved from the offsets if < 0).

    ``validate=False`` with ``max_seqlen >= 0`` skips the value checks and their host sync.
    """
    if validate or max_seqlen < 0:
        max_seqlen = check_values(q, k, offsets, kv_offsets, num_targets, max_seqlen)
    out, lse2 = _fwd(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
                     window_left, window_right, max_seqlen)
    return out, lse2, torch.tensor(max_seqlen, dtype=torch.int64)


@jagged_attention_fwd_op.register_fake
def _(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm, window_left,
      window_right, max_seqlen, validate=True):
    H, dv = q.shape[1], v.shape[2]
    if offsets is None:
        rows = (kv_offsets.shape[0] - 1) * q.shape[0]
    else:
        rows = q.shape[0]
    out = q.new_empty(rows, H, dv)
    lse2 = q.new_empty(rows if activation == "softmax" else 0, H, dtype=torch.float32)
    return out, lse2, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("gemcore::jagged_attention_bwd", mutates_args=())
def jagged_attention_bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse2: torch.Tensor, offsets: Optional[torch.Tensor], kv_offsets: Optional[torch.Tensor],
    num_targets: Optional[torch.Tensor], activation: str, causal: bool, scale: float,
    norm: float, window_left: int, window_right: int, max_seqlen: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dq, dk, dv); ``max_seqlen`` is the forward's resolved 0-d int64 tensor."""
    return _bwd(do, q, k, v, out, lse2, offsets, kv_offsets, num_targets, activation, causal,
                scale, norm, window_left, window_right, int(max_seqlen))


@jagged_attention_bwd_op.register_fake
def _(do, q, k, v, out, lse2, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
      window_left, window_right, max_seqlen):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    (q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm, window_left,
     window_right, _max_seqlen, *_validate) = inputs
    out, lse2, max_seqlen = output
    ctx.save_for_backward(q, k, v, out, lse2, offsets, kv_offsets, num_targets, max_seqlen)
    ctx.static = (activation, causal, scale, norm, window_left, window_right)


def _backward(ctx, dout, _dlse2, _dmax):
    q, k, v, out, lse2, offsets, kv_offsets, num_targets, max_seqlen = ctx.saved_tensors
    activation, causal, scale, norm, window_left, window_right = ctx.static
    dq, dk, dv = jagged_attention_bwd_op(
        dout, q, k, v, out, lse2, offsets, kv_offsets, num_targets, activation, causal, scale,
        norm, window_left, window_right, max_seqlen)
    return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("gemcore::jagged_attention_fwd", _backward,
                                setup_context=_setup_context)


def _checked_fwd(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
                 window_left, window_right, max_seqlen, validate, with_max_seqlen=False):
    """The value checks (unless skipped, see ``jagged_attention_fwd_op``) and :func:`_fwd`'s
    (out, lse2); with ``with_max_seqlen``, ((out, lse2), the resolved max_seqlen)."""
    if validate or max_seqlen < 0:
        max_seqlen = check_values(q, k, offsets, kv_offsets, num_targets, max_seqlen)
    result = _fwd(q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
                  window_left, window_right, max_seqlen)
    return (result, max_seqlen) if with_max_seqlen else result


class _EagerJaggedAttention(torch.autograd.Function):
    """The custom ops' eager twin: the same checks and kernels through a plain autograd Function,
    without the custom-op dispatch (about 0.1 ms of host time per forward on an H200 host, more
    for the backward). Used only where nothing needs to see the op (see ``_needs_custom_op``)."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kv_offsets, num_targets, activation, causal, scale, norm,
                window_left, window_right, max_seqlen, validate):
        (out, lse2), max_seqlen = _checked_fwd(q, k, v, offsets, kv_offsets, num_targets, activation,
                                               causal, scale, norm, window_left, window_right,
                                               max_seqlen, validate, with_max_seqlen=True)
        ctx.save_for_backward(q, k, v, out, lse2, offsets, kv_offsets, num_targets)
        ctx.static = (activation, causal, scale, norm, window_left, window_right, max_seqlen)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse2, offsets, kv_offsets, num_targets = ctx.saved_tensors
        dq, dk, dv = _bwd(dout, q, k, v, out, lse2, offsets, kv_offsets, num_targets, *ctx.static)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None, None, None


def _needs_custom_op(*tensors) -> bool:
    """True where the call must go through the registered custom ops: under torch.compile (so it
    traces them), under a dispatch mode (selective activation checkpointing's policy saves the
    op's outputs by name; FakeTensor; FlopCounterMode) and for tensor subclasses."""
    return (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or any(t is not None and type(t) is not torch.Tensor for t in tensors))


def jagged_attention_triton(q, k, v, offsets, *, kv_offsets=None, activation="softmax",
                            causal=False, scale=None, norm=None, num_targets=None, window=None,
                            max_seqlen=None, validate=True):
    """Triton backend of :func:`gemcore.kernels.jagged_attention` (static checks already done)."""
    left, right = window_bounds(window)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    args = (q, k, v, offsets, kv_offsets, num_targets, activation, bool(causal), scale,
            float(norm) if norm is not None else 0.0, left, right,
            -1 if max_seqlen is None else int(max_seqlen), bool(validate))
    if _needs_custom_op(q, k, v, offsets, kv_offsets, num_targets):
        out, _, _ = jagged_attention_fwd_op(*args)
    elif torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _EagerJaggedAttention.apply(*args)
    else:  # nothing to differentiate: the forward alone, without the autograd Function's dispatch
        out, _ = _checked_fwd(*args)
    if offsets is None:
        return out.view(kv_offsets.shape[0] - 1, q.shape[0], q.shape[1], v.shape[2])
    return out
