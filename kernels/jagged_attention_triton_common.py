"""Triton jagged attention, shared pieces: activations, sequence bounds, tile ranges and masks.

The kernels are in :mod:`~gemcore.kernels.jagged_attention_triton_fwd` (forward) and
:mod:`~gemcore.kernels.jagged_attention_triton_bwd` (dK/dV and dQ, no atomics).

Grid of every kernel: axis 0 = (sequence b, head h), axis 1 = tile of the sequence, heaviest
tiles first under a causal mask: the forward and dQ reverse axis 1 (a sequence's last query tiles
see the most keys), dK/dV keeps it (a sequence's first key tiles are seen by the most queries). Tiles past a sequence's end exit at once, so
memory and work follow the real tokens, not B x max_len.

Masking: each program splits its loop in three ranges: the tiles wholly inside the allowed
region (:func:`_full_keys` / :func:`_full_queries`) run without any mask or bounds check, and only
the boundary tiles before and after them build the element mask.
Tiles wholly outside it (causal future, outside the window) are never visited.

Semantics are those of :mod:`gemcore.kernels.jagged_attention_reference`. Softmax keeps the
log-sum-exp in base 2 (``lse2``) for the backward; a row with no allowed key stores ``+inf`` there
and produces zeros.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: activation name -> ACTIVATION constexpr code of the kernels
ACTIVATION_CODES = {"softmax": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4, "relu2": 5,
                    "identity": 6}


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """sigmoid(x) (x float32). FAST: ``(1 + tanh(x/2)) / 2`` with the hardware
    ``tanh.approx.f32`` (one MUFU op instead of exp + reciprocal; absolute error about 2^-11,
    below bf16's rounding of the activations, so only used for 16-bit inputs on a GPU)."""
    if FAST:
        t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [0.5 * x],
                                      dtype=tl.float32, is_pure=True, pack=1)
        y = 0.5 * t + 0.5
    else:
        y = tl.sigmoid(x)
    return y


@triton.jit
def _act(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """act(x) for the non-softmax activations (x float32); FAST as in :func:`_sigmoid`. The math is
    :func:`_act_and_grad`'s (the unused derivative is dead code)."""
    y, _ = _act_and_grad(x, ACTIVATION, FAST)
    return y


@triton.jit
def _act_and_grad(x, ACTIVATION: tl.constexpr, FAST: tl.constexpr):
    """(act(x), d act / dx) for the non-softmax activations (x float32), sharing one sigmoid;
    a caller that uses only the derivative leaves act to dead-code elimination."""
    if ACTIVATION == 1:
        s = _sigmoid(x, FAST)
        y = x * s
        g = s + y * (1.0 - s)  # s (1 + x (1 - s))
    elif ACTIVATION == 2:
        cdf = 0.5 * (1.0 + tl.erf(x * 0.7071067811865476))
        y = x * cdf
        g = cdf + x * 0.3989422804014327 * tl.exp(-0.5 * x * x)
    elif ACTIVATION == 3:
        u = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        s = _sigmoid(2.0 * u, FAST)  # (1 + tanh u) / 2
        y = x * s
        # d/dx [x s] = s + x * ds/du * du/dx, ds/du = 2 s (1 - s)
        g = s + y * 2.0 * (1.0 - s) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x)
    elif ACTIVATION == 4:
        y = tl.maximum(x, 0.0)
        g = tl.where(x > 0.0, 1.0, 0.0)
    elif ACTIVATION == 5:
        r = tl.maximum(x, 0.0)
        y = r * r
        g = 2.0 * r
    else:
        y = x
        g = tl.full(x.shape, 1.0, tl.float32)
    return y, g


@triton.jit
def _sequence(b, q_offsets, kv_offsets, num_targets, NQ_POOLED, POOLED: tl.constexpr,
              HAS_TARGETS: tl.constexpr):
    """Rows of sequence b: (q_start, o_start, q_len, kv_start, kv_len, history)."""
    kv_start = tl.load(kv_offsets + b)
    kv_len = (tl.load(kv_offsets + b + 1) - kv_start).to(tl.int32)
    if POOLED:
        q_start = kv_start * 0
        q_len = kv_len * 0 + NQ_POOLED
        o_start = q_start + b.to(tl.int64) * NQ_POOLED
    else:
        q_start = tl.load(q_offsets + b)
        q_len = (tl.load(q_offsets + b + 1) - q_start).to(tl.int32)
        o_start = q_start
    if HAS_TARGETS:
        history = q_len - tl.load(num_targets + b).to(tl.int32)
    else:
        history = q_len
    return q_start, o_start, q_len, kv_start, kv_len, history


@triton.jit
def _part(part: tl.constexpr, lo, f_lo, f_hi, hi):
    """Tile range ``part`` of a row block's loop: 0 the whole tiles [f_lo, f_hi) (no mask), 1 the
    masked tiles before them [lo, f_lo), 2 the masked tiles after them [f_hi, hi)."""
    if part == 0:
        return f_lo, f_hi
    elif part == 1:
        return lo, f_lo
    else:
        return f_hi, hi


@triton.jit
def _full_keys(m0, lo, hi, q_len, kv_len, history, left, right, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[f_lo, f_hi) within [lo, hi), multiples of BLOCK_N from lo: key tiles that every row of
    [m0, m0+BLOCK_M) may see whole, so they need no mask. Conservative (a subset)."""
    f_lo = lo
    f_hi = (kv_len // BLOCK_N) * BLOCK_N
    if CAUSAL:  # n0 + BLOCK_N - 1 <= m0
        f_hi = tl.minimum(f_hi, ((m0 + 1) // BLOCK_N) * BLOCK_N)
    if HAS_TARGETS:  # candidates among the rows see whole tiles of history only
        if m0 + BLOCK_M > history:
            f_hi = tl.minimum(f_hi, (history // BLOCK_N) * BLOCK_N)
    if HAS_RIGHT:  # n0 + BLOCK_N - 1 - m0 <= right
        f_hi = tl.minimum(f_hi, ((m0 + right + 1) // BLOCK_N) * BLOCK_N)
    if HAS_LEFT:  # m0 + BLOCK_M - 1 - n0 <= left
        f_lo = tl.maximum(f_lo, ((tl.maximum(m0 + BLOCK_M - 1 - left, 0) + BLOCK_N - 1) // BLOCK_N) * BLOCK_N)
    if m0 + BLOCK_M > q_len:
        f_hi = f_lo
    f_lo = tl.minimum(f_lo, hi)
    f_hi = tl.maximum(tl.minimum(f_hi, hi), f_lo)
    return f_lo, f_hi


@triton.jit
def _full_queries(n0, lo, hi, q_len, kv_len, history, left, right, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr,
                  HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """[f_lo, f_hi) within [lo, hi), multiples of BLOCK_M from lo: query tiles that see all of
    keys [n0, n0+BLOCK_N), so they need no mask. Conservative (a subset)."""
    f_lo = lo
    f_hi = (q_len // BLOCK_M) * BLOCK_M
    if CAUSAL:  # m0 >= n0 + BLOCK_N - 1
        f_lo = tl.maximum(f_lo, ((n0 + BLOCK_N - 1 + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    if HAS_TARGETS:  # keys past the history are seen whole only by history rows
        if n0 + BLOCK_N > history:
            f_hi = tl.minimum(f_hi, (history // BLOCK_M) * BLOCK_M)
    if HAS_LEFT:  # m0 + BLOCK_M - 1 - n0 <= left
        f_hi = tl.minimum(f_hi, ((n0 + left + 1) // BLOCK_M) * BLOCK_M)
    if HAS_RIGHT:  # n0 + BLOCK_N - 1 - m0 <= right
        f_lo = tl.maximum(f_lo, ((tl.maximum(n0 + BLOCK_N - 1 - right, 0) + BLOCK_M - 1) // BLOCK_M) * BLOCK_M)
    if n0 + BLOCK_N > kv_len:
        f_hi = f_lo
    f_lo = tl.minimum(f_lo, hi)
    f_hi = tl.maximum(tl.minimum(f_hi, hi), f_lo)
    return f_lo, f_hi


@triton.jit
def _allowed(i, j, q_len, kv_len, history, left, right, CAUSAL: tl.constexpr,
             HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr):
    """Element mask for broadcastable query positions i and key positions j."""
    mask = (i < q_len) & (j < kv_len)
    if CAUSAL:
        mask = mask & (j <= i)
    if HAS_TARGETS:
        mask = mask & ((j < history) | (j == i))
    if HAS_LEFT:
        if HAS_TARGETS:  # candidates' positions are clamped to the history's end
            mask = mask & (tl.minimum(i, history) - j <= left)
        else:
            mask = mask & (i - j <= left)
    if HAS_RIGHT:
        mask = mask & (j - i <= right)
    return mask


@triton.jit
def _key_range(m0, kv_len, history, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
               HAS_RIGHT: tl.constexpr):
    """[lo, hi) of keys that rows [m0, m0+BLOCK_M) may see; lo is a multiple of BLOCK_N.
    With targets, the window of candidate rows starts from the history's end."""
    lo = m0 * 0
    hi = kv_len
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
    if HAS_RIGHT:
        hi = tl.minimum(hi, m0 + BLOCK_M + right)
    if HAS_LEFT:
        if HAS_TARGETS:
            lo = tl.maximum(lo, tl.minimum(m0, history) - left)
        else:
            lo = tl.maximum(lo, m0 - left)
        lo = (lo // BLOCK_N) * BLOCK_N
    return lo, hi


@triton.jit
def _query_range(n0, q_len, history, left, right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAUSAL: tl.constexpr, HAS_TARGETS: tl.constexpr, HAS_LEFT: tl.constexpr,
                 HAS_RIGHT: tl.constexpr):
    """[lo, hi) of rows that may see keys [n0, n0+BLOCK_N); lo is a multiple of BLOCK_M.
    With targets, every candidate row sees the keys within ``left`` of the history's end."""
    lo = n0 * 0
    hi = q_len
    if CAUSAL:
        lo = tl.maximum(lo, n0)
    if HAS_RIGHT:
        lo = tl.maximum(lo, n0 - right)
    if HAS_LEFT:
        reach = n0 + BLOCK_N + left  # rows below it may see the tile (positions unclamped)
        if HAS_TARGETS:  # the candidates, clamped to the history's end, see its history keys
            reach = tl.where((reach > history) & (n0 < history), q_len, reach)
        hi = tl.minimum(hi, reach)
    lo = (lo // BLOCK_M) * BLOCK_M
    return lo, hi
