"""Triton jagged attention against the reference: output and every gradient.

On CPU this module only runs under TRITON_INTERPRET=1 (test_jagged_attention.py starts it in a
subprocess with that set): float32 inputs (Triton 3.9's interpreter gets tl.dot on bfloat16 wrong),
16x16 tiles pinned so every path crosses tile borders. On a CUDA GPU it runs at real sizes in
bfloat16 and float32 with the default tiles of ``CONFIGS``.
"""
from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# the interpreter runs on CPU tensors, also on a machine with a GPU (its GPU-tensor mode fails in
# Triton 3.6 with "only 0-dimensional arrays can be converted to Python scalars")
CUDA = torch.cuda.is_available() and not INTERPRET
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (CUDA or INTERPRET),
                                 reason="needs a CUDA GPU or TRITON_INTERPRET=1 (run by test_jagged_attention.py)")]
triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402

from gemcore.kernels.jagged_attention import jagged_attention  # noqa: E402
from gemcore.kernels.jagged_attention_reference import jagged_attention_reference  # noqa: E402
from gemcore.kernels.jagged_attention_triton import (  # noqa: E402
    TileConfig, jagged_attention_bwd_op, jagged_attention_fwd_op, pinned_configs)
from gemcore.kernels.jagged_attention_triton_common import (  # noqa: E402
    ACTIVATION_CODES, _act, _act_and_grad)

DEVICE = "cuda" if CUDA else "cpu"
SMALL = TileConfig(16, 16, 1, 1)


def _offsets(lengths):
    lengths = torch.tensor(lengths, dtype=torch.int64)
    return torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(DEVICE)


def _rel_err(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def check_parity(lengths, *, kv_lengths=None, pma=0, activation="softmax", causal=False,
                 targets=None, window=None, H=2, D=16, Dv=16, dtype=torch.float32, seed=0, tol=None):
    """Output and dq, dk, dv of backend="triton" against the reference on the same inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    offsets = _offsets(lengths)
    kv_offsets = _offsets(kv_lengths) if kv_lengths is not None else None
    tq = pma if pma else int(offsets[-1])
    tk = int((kv_offsets if kv_offsets is not None else offsets)[-1])
    q, k = (torch.randn(t, H, D, generator=g, device=DEVICE).to(dtype).requires_grad_() for t in (tq, tk))
    v = torch.randn(tk, H, Dv, generator=g, device=DEVICE).to(dtype).requires_grad_()
    kw = dict(kv_offsets=kv_offsets, activation=activation, causal=causal, window=window,
              num_targets=None if targets is None else torch.tensor(targets, device=DEVICE))
    off = None if pma else offsets
    got = jagged_attention(q, k, v, off, backend="triton", **kw)
    want = jagged_attention(q, k, v, off, backend="reference", **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    if tol is None:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert _rel_err(got, want) <= tol, ("out", _rel_err(got, want))
    if got.numel() == 0:
        return
    grad = torch.randn(got.shape, generator=g, device=DEVICE).to(dtype)
    g_got = torch.autograd.grad(got, (q, k, v), grad, allow_unused=True)
    g_want = torch.autograd.grad(want, (q, k, v), grad, allow_unused=True)
    for name, a, b in zip("qkv", g_got, g_want):
        b = torch.zeros_like(a) if b is None else b
        if b.abs().max() == 0:  # e.g. dq of a lone key: zero exactly, here up to rounding
            assert float(a.abs().max()) <= tol, name
        else:
            assert _rel_err(a, b) <= tol, ("d" + name, _rel_err(a, b))


@pytest.fixture(autouse=True)
def _small_tiles():
    if INTERPRET:
        with pinned_configs(fwd=SMALL, dkdv=SMALL, dq=SMALL):
            yield
    else:
        yield


ACTS = ["softmax", "silu", "gelu", "gelu_tanh", "relu", "relu2", "identity"]
LENGTHS = [0, 1, 19, 33] if INTERPRET else [0, 1, 17, 40, 5, 32, 300, 129]
TARGETS = [0, 1, 3, 33] if INTERPRET else [0, 1, 3, 40, 2, 16, 7, 129]


@pytest.mark.parametrize("activation", ACTS)
def test_self_attention_causal(activation):
    check_parity(LENGTHS, activation=activation, causal=True)


# the interpreter is slow: in it, full attention for the activations with distinct code paths
@pytest.mark.parametrize("activation", ["softmax", "gelu", "relu2"] if INTERPRET else ACTS)
def test_self_attention_full(activation):
    check_parity(LENGTHS, activation=activation, causal=False)


@pytest.mark.parametrize("activation, window", [("softmax", (7, 0)), ("silu", (3, 20)),
                                                ("softmax", (None, 5))])
def test_num_targets_and_window(activation, window):
    check_parity(LENGTHS, activation=activation, causal=True, targets=TARGETS)
    check_parity(LENGTHS, activation=activation, causal=window[1] == 0, window=window)


# candidates far past history + window (their clamped window starts at the history's end), no
# candidates, all candidates, empty and length-1 sequences; 16-row tiles in the interpreter
TW_LENGTHS = [0, 1, 50, 1, 19, 40] if INTERPRET else [0, 1, 700, 1, 129, 300, 64, 2000]
TW_TARGETS = [0, 1, 20, 0, 0, 40] if INTERPRET else [0, 1, 300, 0, 0, 300, 17, 1500]


def check_against_float64(lengths, targets, window, activation, dtype=torch.float32, tol=1e-5):
    """Triton output and gradients against the reference run on float64 copies of the inputs."""
    g = torch.Generator(device=DEVICE).manual_seed(len(lengths))
    offsets = _offsets(lengths)
    T = int(offsets[-1])
    q, k, v = (torch.randn(T, 2, 16, generator=g, device=DEVICE).to(dtype).requires_grad_()
               for _ in range(3))
    kw = dict(activation=activation, causal=True, window=window,
              num_targets=torch.tensor(targets, device=DEVICE))
    got = jagged_attention(q, k, v, offsets, backend="triton", **kw)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = jagged_attention_reference(q64, k64, v64, offsets, **kw)
    assert _rel_err(got, want) <= tol, ("out", _rel_err(got, want))
    grad = torch.randn(got.shape, generator=g, device=DEVICE).to(dtype)
    g_got = torch.autograd.grad(got, (q, k, v), grad)
    g_want = torch.autograd.grad(want, (q64, k64, v64), grad.double())
    for name, a, b in zip("qkv", g_got, g_want):
        assert _rel_err(a, b) <= tol, ("d" + name, _rel_err(a, b))


@pytest.mark.parametrize("activation, window", [("softmax", (1, 0)), ("silu", (5, None)),
                                                ("softmax", (17, 0)), ("gelu", (0, 0)),
                                                ("softmax", (None, 0))])
def test_targets_with_window_clamp_candidates_to_history_end(activation, window):
    check_against_float64(TW_LENGTHS, TW_TARGETS, window, activation)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("left", [1, 37, 256])
def test_targets_with_window_bf16_on_gpu(activation, left):
    check_against_float64(TW_LENGTHS, TW_TARGETS, (left, 0), activation, dtype=torch.bfloat16, tol=2e-2)


@pytest.mark.parametrize("activation", ["softmax", "gelu_tanh"])
def test_cross_and_pooled(activation):
    check_parity([3, 0, 20, 33], kv_lengths=[5, 4, 0, 17], activation=activation)
    check_parity([3, 0, 20, 33], kv_lengths=[5, 4, 0, 17], activation=activation, window=(2, 3))
    check_parity([1], kv_lengths=[5, 0, 33], pma=5, activation=activation)


def test_head_dims_not_powers_of_two():
    check_parity([9, 21], causal=True, D=24, Dv=8)
    check_parity([9, 21], activation="silu", causal=True, D=24, Dv=8)


@settings(max_examples=2 if INTERPRET else 30, deadline=None)
@given(lengths=st.lists(st.integers(0, 40 if INTERPRET else 700), min_size=1, max_size=3 if INTERPRET else 8),
       activation=st.sampled_from(["softmax", "silu", "relu2"]), seed=st.integers(0, 1000))
def test_random_lengths(lengths, activation, seed):
    check_parity(lengths, activation=activation, causal=True, seed=seed,
                 targets=[(seed * (b + 1)) % (n + 1) for b, n in enumerate(lengths)])


def test_eager_function_and_custom_op_agree():
    """Eager calls go through a plain autograd Function; under a dispatch mode (selective
    checkpointing, FakeTensor, FlopCounterMode) and torch.compile the same kernels run as the custom
    ops. Both paths: same output and gradients, bit for bit."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from gemcore.kernels import jagged_attention_triton as jt

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    offsets = _offsets([3, 0, 18, 1])
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = (torch.randn(22, 2, 16, generator=g, device=DEVICE).requires_grad_() for _ in range(3))
    grad = torch.randn(22, 2, 16, generator=g, device=DEVICE)
    results = []
    for mode in (None, Passthrough()):
        with mode if mode is not None else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert jt._needs_custom_op(q) == (mode is not None)
            out = jagged_attention(q, k, v, offsets, causal=True, backend="triton", max_seqlen=18,
                                   validate=False)
            results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_fake_implementation_matches_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    offsets = _offsets([3, 0, 18])
    q, k, v = (torch.randn(21, 2, 16, device=DEVICE) for _ in range(3))
    args = (offsets, None, None, "softmax", True, 0.25, 0.0, -1, -1, -1)
    real = jagged_attention_fwd_op(q, k, v, *args)
    real_grads = jagged_attention_bwd_op(real[0], q, k, v, real[0], real[1], offsets, None, None,
                                         "softmax", True, 0.25, 0.0, -1, -1, real[2])
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv, foff = (mode.from_tensor(t) for t in (q, k, v, offsets))
        fake = jagged_attention_fwd_op(fq, fk, fv, foff, *args[1:])
        fake_grads = jagged_attention_bwd_op(fake[0], fq, fk, fv, fake[0], fake[1], foff, None, None,
                                             "softmax", True, 0.25, 0.0, -1, -1, fake[2])
    for r, f in zip(real + real_grads, fake + fake_grads):
        assert r.shape == f.shape and r.dtype == f.dtype


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 and real sizes)")
@pytest.mark.parametrize("activation", ["softmax", "silu", "gelu_tanh"])
def test_bf16_real_sizes(activation):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 1500, (12,), generator=g).tolist() + [0, 1, 2048]
    check_parity(lengths, activation=activation, causal=True, H=4, D=128, Dv=128,
                 dtype=torch.bfloat16, targets=[n // 10 for n in lengths])
    check_parity(lengths, activation=activation, causal=True, H=4, D=64, Dv=64, dtype=torch.float32)
    check_parity(lengths, kv_lengths=[256] * len(lengths), activation=activation, H=4, D=128,
                 Dv=128, dtype=torch.bfloat16)
    for nq in (16, 100):  # pooled: query tiles fitted to Nq
        check_parity([1], kv_lengths=lengths, pma=nq, activation=activation, H=4, D=128, Dv=128,
                     dtype=torch.bfloat16)


def test_query_tile_fits_the_longest_query_run():
    from gemcore.kernels.jagged_attention_triton import _fit_rows

    cfg = TileConfig(128, 64, 8, 3)
    assert _fit_rows(cfg, 16) == TileConfig(16, 64, 4, 3)
    assert _fit_rows(cfg, 100) == _fit_rows(cfg, 128) == _fit_rows(cfg, 5000) == cfg
    assert _fit_rows(cfg, 33).block_m == 64 and _fit_rows(cfg, 0).block_m == 16


def test_pointwise_activations_take_their_own_tiles(monkeypatch):
    from gemcore.kernels import jagged_attention_triton as jt

    monkeypatch.setattr(jt, "_pinned", {})                    # the interpreter's small tiles off
    softmax_tile = jt._config("fwd", 128, torch.bfloat16, 4096)
    assert softmax_tile == jt.CONFIGS[("fwd", 128)]
    assert jt._config("fwd", 128, torch.bfloat16, 4096, "silu") == softmax_tile   # no entry: shared
    assert jt._config("dkdv", 128, torch.bfloat16, 4096, "silu") == TileConfig(64, 128, 8, 3)
    monkeypatch.setitem(jt.POINTWISE_CONFIGS, ("fwd", 128), TileConfig(64, 128, 8, 2))
    assert jt._config("fwd", 128, torch.bfloat16, 4096, "silu") == TileConfig(64, 128, 8, 2)
    assert jt._config("fwd", 100, torch.bfloat16, 4096, "gelu_tanh") == TileConfig(64, 128, 8, 2)
    assert jt._config("fwd", 128, torch.bfloat16, 4096, "softmax") == softmax_tile
    assert jt._config("dq", 128, torch.bfloat16, 4096, "silu") == jt.CONFIGS[("dq", 128)]


def test_fast_activation_only_for_16_bit_cuda_inputs():
    from gemcore.kernels.jagged_attention_triton import _fast_act

    x32, x16 = torch.zeros(1), torch.zeros(1, dtype=torch.bfloat16)
    assert not _fast_act(x32, "silu") and not _fast_act(x16, "silu")  # CPU: interpreter
    if CUDA:
        assert _fast_act(x16.cuda(), "silu") and _fast_act(x16.cuda(), "gelu_tanh")
        assert not _fast_act(x32.cuda(), "silu") and not _fast_act(x16.cuda(), "gelu")


@triton.jit
def _apply_activation(X, Y, G, N, ACTIVATION: tl.constexpr, FAST: tl.constexpr,
                      BLOCK: tl.constexpr):
    """X <- act(X), G <- act'(X), Y <- the difference of the two helpers' act."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < N)
    y, g = _act_and_grad(x, ACTIVATION, FAST)
    tl.store(Y + offs, _act(x, ACTIVATION, FAST) - y, mask=offs < N)
    tl.store(G + offs, g, mask=offs < N)
    tl.store(X + offs, y, mask=offs < N)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (inline PTX tanh.approx)")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_fast_sigmoid_activation_and_gradient(activation):
    """The hardware-tanh path of act and act' against the exact one, pointwise over [-30, 30]."""
    x = torch.linspace(-30, 30, 60001, device=DEVICE)
    out = {}
    for fast in (False, True):
        xs, y_diff, g = x.clone(), torch.empty_like(x), torch.empty_like(x)
        _apply_activation[(triton.cdiv(x.numel(), 1024),)](
            xs, y_diff, g, x.numel(), ACTIVATION_CODES[activation], fast, BLOCK=1024)
        # the two helpers' act agree up to rounding (FMA contraction may differ between them)
        assert bool((y_diff.abs() <= 1e-6 * (1 + x.abs())).all())
        out[fast] = xs, g
    if activation == "silu":
        want = torch.nn.functional.silu(x.double())
    else:
        want = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert float((out[False][0] - want).abs().max()) <= 1e-5 * 30
    # tanh.approx: |error| ~ 2^-11 on the sigmoid, times |x| in act and up to |dg/ds| in act'
    bound = 1e-3 * (1 + x.abs())
    assert bool(((out[True][0] - out[False][0]).abs() <= bound).all())
    g_bound = 4 * bound if activation == "silu" else bound * (1 + x.abs()) ** 2
    assert bool(((out[True][1] - out[False][1]).abs() <= g_bound).all())


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (bf16 and the hardware-tanh path)")
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_bf16_fast_activations_full_and_windowed(activation):
    lengths = [0, 1, 17, 300, 129, 700]
    check_parity(lengths, activation=activation, H=4, D=128, Dv=128, dtype=torch.bfloat16)
    check_parity(lengths, activation=activation, causal=True, window=(64, 0), H=4, D=128, Dv=128,
                 dtype=torch.bfloat16)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_torch_compile_without_graph_breaks():
    offsets = _offsets([30, 0, 70])
    q, k, v = (torch.randn(100, 2, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))

    def f(q, k, v):
        return jagged_attention(q * 2, k, v, offsets, causal=True, max_seqlen=70).square().sum()

    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v), rtol=2e-2, atol=1e-1)
    compiled(q, k, v).backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()



def test_torch_compile_keeps_max_seqlen_symbolic():
    """A compiled caller that passes each batch's longest length (as the model does) is compiled
    once, not once per length."""
    from torch._dynamo.testing import CompileCounter

    offsets = _offsets([30, 0, 70])
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, k, v = (torch.randn(100, 2, 32, device=DEVICE, dtype=dtype) for _ in range(3))

    def f(q, k, v, max_seqlen):
        return jagged_attention(q, k, v, offsets, causal=True, max_seqlen=max_seqlen, backend="triton",
                                validate=False)

    counter = CompileCounter()
    compiled = torch.compile(f, backend=counter, dynamic=True, fullgraph=True)
    for longest in (70, 75, 90):
        torch.testing.assert_close(compiled(q, k, v, longest), f(q, k, v, longest))
    assert counter.frame_count == 1

# --------------------------------------------------------------------------- persistent work lists
@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.one_of(st.sampled_from([0, 1, 127, 128, 129, 256]), st.integers(0, 1500)), max_size=40),
       slack=st.sampled_from([0, 1, 300]), from_end=st.booleans())
def test_work_list_holds_every_non_empty_item_once_costliest_first(lengths, slack, from_end):
    """The GPU-built list of the Gluon kernels' (tile, sequence) items against a plain loop: every
    non-empty item exactly once, empty and length-1 sequences among them, max_seqlen above the
    longest length too (empty top levels)."""
    from gemcore.kernels.jagged_work_list import work_list, work_list_reference

    max_len = max(lengths, default=0) + slack
    work, n_listed = work_list(_offsets(lengths), max_len, from_end, n_rows=sum(lengths))
    want = work_list_reference(lengths, max_len, from_end)
    assert int(n_listed) == len(want)
    bound = max(1, (sum(lengths) + 127 * len(lengths)) // 128)       # the real rows bound the capacity
    assert 3 * len(want) <= work.numel() <= 3 * bound
    assert n_listed.data_ptr() % 16 == 0                 # one pointer specialisation for every batch
    B = len(lengths)
    starts = [sum(lengths[:b]) for b in range(B)]
    # three fields per entry: the item, its sequence's start and length
    assert work[:3 * len(want)].view(-1, 3).tolist() == [[x, starts[x % B], lengths[x % B]] for x in want]
    tiles = sorted(divmod(x, B) if B else None for x in want)
    assert tiles == sorted((t, b) for b, n in enumerate(lengths) for t in range(-(-n // 128)))


@pytest.mark.parametrize("lengths", [[], [0, 0], [1], [5, 700, 128, 0, 1300, 1, 260], [129] * 3])
def test_both_lists_from_one_launch_equal_the_lists_built_alone(lengths):
    """The backward's (query tiles, key tiles) pair, built in one launch on fresh offsets, against
    each list built alone; lists and counts at 16-byte boundaries."""
    from gemcore.kernels.jagged_work_list import cached_lists, work_list

    max_len, n_rows = max(lengths, default=0) + 3, sum(lengths)
    both = cached_lists(_offsets(lengths), max_len, n_rows, query=True, key=True)
    for from_end, (work, n_listed) in zip((False, True), both):
        alone, n_alone = work_list(_offsets(lengths), max_len, from_end, n_rows=n_rows)
        assert int(n_listed) == int(n_alone) and work.numel() == alone.numel()
        assert work[:3 * int(n_listed)].tolist() == alone[:3 * int(n_alone)].tolist()
        assert n_listed.data_ptr() % 16 == 0 and work.data_ptr() % 16 == 0


def test_lists_are_built_once_per_offsets_until_they_change():
    """A model's layers share one batch's offsets: the forward's query list is built once and the
    backward reuses it, building only the key list; an in-place write to the offsets (their
    version counter), other arguments, or inference tensors get lists built anew."""
    from gemcore.kernels import jagged_work_list
    from gemcore.kernels.jagged_work_list import cached_lists, work_list_reference

    lengths = [5, 300, 129, 0]
    offsets = _offsets(lengths)
    builds = []
    real_build = jagged_work_list._build

    def counting_build(*args):
        builds.append(args[3:])                          # (query, key)
        return real_build(*args)

    jagged_work_list._build = counting_build
    try:
        (q1,) = cached_lists(offsets, 300, 434, query=True, key=False)     # layer 1's forward
        (q2,) = cached_lists(offsets, 300, 434, query=True, key=False)     # layer 2's forward
        q3, k3 = cached_lists(offsets, 300, 434, query=True, key=True)     # a backward
        q4, k4 = cached_lists(offsets, 300, 434, query=True, key=True)
        assert builds == [(True, False), (False, True)]
        assert q1[0] is q2[0] is q3[0] is q4[0] and k3[0] is k4[0]
        assert k3[0][:3 * int(k3[1]):3].tolist() == work_list_reference(lengths, 300, True)
        cached_lists(offsets, 512, 434, query=True, key=False)             # another max_seqlen
        assert builds[-1] == (True, False)
        offsets[-1] = 434                                                  # an in-place write
        (q5,) = cached_lists(offsets, 300, 434, query=True, key=False)
        assert len(builds) == 4 and q5[0] is not q1[0]
        with torch.inference_mode():
            fresh = _offsets(lengths)
        cached_lists(fresh, 300, 434, query=True, key=False)
        cached_lists(fresh, 300, 434, query=True, key=False)
        assert len(builds) == 6                                            # nothing kept
    finally:
        jagged_work_list._build = real_build


def test_work_list_of_a_batch_wider_than_one_chunk():
    """More sequences than the list kernel reads at once (the chunked path)."""
    from gemcore.kernels.jagged_work_list import _MAX_CHUNK, cached_lists, work_list, work_list_reference

    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(0, 400, (_MAX_CHUNK + 37,), generator=g).tolist()
    for from_end in (False, True):
        work, n_listed = work_list(_offsets(lengths), max(lengths), from_end)
        want = work_list_reference(lengths, max(lengths), from_end)
        assert int(n_listed) == len(want) and work[:3 * len(want):3].tolist() == want
        assert work[1:3 * len(want):3].tolist() == [sum(lengths[:x % len(lengths)]) for x in want]
    (q_work, q_listed), (k_work, k_listed) = cached_lists(_offsets(lengths), max(lengths), None, query=True, key=True)
    for work, n_listed, from_end in ((q_work, q_listed, False), (k_work, k_listed, True)):
        assert work[:3 * int(n_listed):3].tolist() == work_list_reference(lengths, max(lengths), from_end)


def test_work_list_costs_fall_along_the_list():
    """Causal cost of each item (forward: tiles up to its own; dK/dV: tiles from its own to the
    sequence's end) never rises along the list."""
    from gemcore.kernels.jagged_work_list import work_list

    lengths = [5, 700, 128, 0, 1300, 1, 260]
    B = len(lengths)
    for from_end in (False, True):
        work, n_listed = work_list(_offsets(lengths), max(lengths), from_end)
        items = [divmod(x, B) for x in work[:3 * int(n_listed):3].tolist()]
        costs = [(-(-lengths[b] // 128) - t) if from_end else t + 1 for t, b in items]
        assert costs == sorted(costs, reverse=True)
