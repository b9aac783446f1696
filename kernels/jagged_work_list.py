"""Work lists of the persistent attention kernels: which (tile, sequence) items exist, costliest first.

A persistent kernel launches one CTA per SM and deals the work items out. Dealing every
(tile level, sequence) pair of a padded grid in a fixed stride leaves two costs on jagged batches:
most pairs are empty (a level past a short sequence's end) yet each is read and skipped, and the
non-empty ones land unevenly on the CTAs. Modelled with the item costs of the heavytail
benchmark workload (docs/benchmarks.md, "Workloads"), the busiest CTA of that stride gets 1.44× the mean work; the list below, dealt in a
snake order (CTA p takes item p of round 0, item 2P-1-p of round 1, ...), gets 1.02×. Measured
on an H200 against the strided schedule (same results bit for bit): heavytail forward +23–31 %,
backward +19–22 %; dense95 backward +0.5 %, forward −0.7 to −2.5 % (docs/kernels.md).

The list is built on the GPU by one single-program Triton kernel (no host sync, so the launch
stays asynchronous), from the offsets alone, and kept on the offsets tensor
(:func:`cached_lists`): a model's layers share one batch's offsets, so a step builds each list
once.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gemcore.kernels.kernel_launch import current_stream

#: rows per tile: the Gluon kernels' 128-row work items
TILE_ROWS = 128
#: sequences per chunk of the list kernel; batches up to this many are read once
_MAX_CHUNK = 4096
#: int32 fields per list entry: (item code, sequence start, sequence length), so that a kernel
#: reads an item's sequence without a second, dependent load of the offsets (against the code
#: alone, on an H200: dense95 forward +0.8 to +1.9 %, heavytail +1.4 to +1.8 %; docs/kernels.md)
ENTRY_FIELDS = 3


@triton.jit
def _sequences(offsets, b, B, TILE: tl.constexpr):
    """(128-row tiles, start, length) of sequences b, int32 (masked past B: 0)."""
    ok = b < B
    end = tl.load(offsets + b + 1, mask=ok, other=0)
    start = tl.load(offsets + b, mask=ok, other=0)
    length = end - start
    return tl.cdiv(length, TILE).to(tl.int32), start.to(tl.int32), length.to(tl.int32)


@triton.jit
def _list_level(work, n_tiles, start, length, b, B, level, listed, FROM_END: tl.constexpr):
    """Appends the items of one level (sequences with more than ``level`` tiles, in order of b)
    at ``listed``; returns the new length."""
    valid = level < n_tiles
    tile = n_tiles - 1 - level if FROM_END else level + 0 * n_tiles
    flags = valid.to(tl.int32)
    pos = listed + tl.cumsum(flags, 0) - 1
    tl.store(work + 3 * pos, tile * B + b, mask=valid)
    tl.store(work + 3 * pos + 1, start, mask=valid)
    tl.store(work + 3 * pos + 2, length, mask=valid)
    return listed + tl.sum(flags, 0)


@triton.jit
def _work_list_kernel(offsets, q_work, q_listed, k_work, k_listed, B, n_levels, QUERY: tl.constexpr,
                      KEY: tl.constexpr, TILE: tl.constexpr, BLOCK_B: tl.constexpr, ONE_CHUNK: tl.constexpr):
    """One program. Levels from n_levels-1 down to 0; per item (t·B + b, the sequence's start, its
    length): with QUERY into ``q_work``, t = level; with KEY into ``k_work``, t = the sequence's
    tile count - 1 - level; the counts into ``q_listed`` / ``k_listed``."""
    q_n = 0
    k_n = 0
    if ONE_CHUNK:                                  # B <= BLOCK_B: the sequences read once
        b = tl.arange(0, BLOCK_B)
        n_tiles, start, length = _sequences(offsets, b, B, TILE)
        for i in range(n_levels):
            if QUERY:
                q_n = _list_level(q_work, n_tiles, start, length, b, B, n_levels - 1 - i, q_n, False)
            if KEY:
                k_n = _list_level(k_work, n_tiles, start, length, b, B, n_levels - 1 - i, k_n, True)
    else:
        for i in range(n_levels):
            for b0 in range(0, B, BLOCK_B):
                b = b0 + tl.arange(0, BLOCK_B)
                n_tiles, start, length = _sequences(offsets, b, B, TILE)
                if QUERY:
                    q_n = _list_level(q_work, n_tiles, start, length, b, B, n_levels - 1 - i, q_n, False)
                if KEY:
                    k_n = _list_level(k_work, n_tiles, start, length, b, B, n_levels - 1 - i, k_n, True)
    if QUERY:
        tl.store(q_listed, q_n)
    if KEY:
        tl.store(k_listed, k_n)


def _build(offsets: torch.Tensor, max_seqlen: int, n_rows: int | None, query: bool,
           key: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The query-tile list (if ``query``) and the key-tile list (if ``key``), in that order, from
    one allocation and one launch (see :func:`work_list`)."""
    B = offsets.numel() - 1
    n_levels = math.ceil(max_seqlen / TILE_ROWS)
    capacity = n_levels * B                        # sum over b of ceil(len_b / 128), at most
    if n_rows is not None:
        capacity = min(capacity, (n_rows + (TILE_ROWS - 1) * B) // TILE_ROWS)
    # one allocation (no fill kernel: the list kernel writes the counts), each list and count at a
    # 16-byte boundary (so the kernels' pointer specialisation never changes with the batch); at
    # least one entry: an empty CUDA tensor's null pointer is not a kernel argument
    size = max(capacity, 1) * ENTRY_FIELDS
    stride = -(-size // 4) * 4 + 4                 # a list, padded, then its count (and padding)
    n_lists = int(query) + int(key)
    buffer = torch.empty(n_lists * stride, device=offsets.device, dtype=torch.int32)
    lists = [(buffer[i * stride:i * stride + size], buffer[(i + 1) * stride - 4:(i + 1) * stride - 3])
             for i in range(n_lists)]
    if n_levels * B == 0:
        return [(work, n_listed.zero_()) for work, n_listed in lists]
    block = min(triton.next_power_of_2(B), _MAX_CHUNK)
    (q_work, q_listed), (k_work, k_listed) = lists[0], lists[-1]
    _work_list_kernel[(1,)](offsets, q_work, q_listed, k_work, k_listed, B, n_levels, QUERY=query, KEY=key,
                            TILE=TILE_ROWS, BLOCK_B=block, ONE_CHUNK=B <= block,
                            num_warps=4 if block <= 1024 else 8)
    return lists


def work_list(offsets: torch.Tensor, max_seqlen: int, from_end: bool,
              n_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(work (capacity·3,) int32, n_listed (1,) int32) for offsets (B+1,) int64 of sequences
    of at most max_seqlen rows, n_levels = ceil(max_seqlen / 128). The first n_listed entries are
    the non-empty items t·B + b (tile t: rows [128 t, 128 t + 128) of sequence b), costliest
    first under causal attention, each followed by b's start and length (ENTRY_FIELDS = 3 int32
    per entry); the rest of ``work`` is not written. ``n_rows``: offsets[-1] (the rows of
    all sequences, known on the host), which bounds the items by (n_rows + 127·B) // 128, so the
    list grows with the real rows, not with B·max_seqlen (capacity: the smaller bound).

    - ``from_end=False`` (the forward and dQ: query tiles, whose cost grows with t): tile levels
      from the highest down, each level's sequences in order.
    - ``from_end=True`` (dK/dV: key tiles, whose cost grows with the rows after them): level
      ``l`` of sequence b is its tile n_tiles(b) - 1 - l, the tile with l tiles after it; so the
      highest level lists the tiles with the most rows after them.
    """
    return _build(offsets, max_seqlen, n_rows, query=not from_end, key=from_end)[0]


#: the attribute of an offsets tensor that keeps the lists built from it (:func:`cached_lists`)
_CACHE_ATTR = "_gemcore_work_lists"


def _list_cache(offsets: torch.Tensor) -> dict | None:
    """The lists already built from ``offsets`` (for the current stream and the offsets' current
    contents), or None where keeping them is not safe: an inference tensor (no version counter
    to see in-place writes by) or a CUDA graph capture (a replay may change the offsets in place
    without Python seeing it)."""
    if offsets.is_inference():
        return None
    stream = None
    if offsets.is_cuda:  # torch.cuda's is_current_stream_capturing / current_stream, without their wrappers
        if torch._C._cuda_isCurrentStreamCapturing():
            return None
        stream = current_stream(offsets.device.index)
    cache = getattr(offsets, _CACHE_ATTR, None)
    if cache is None or cache["version"] != offsets._version or cache["stream"] != stream:
        cache = {"version": offsets._version, "stream": stream}
        setattr(offsets, _CACHE_ATTR, cache)
    return cache


def cached_lists(offsets: torch.Tensor, max_seqlen: int, n_rows: int | None, *, query: bool,
                 key: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`work_list`'s query-tile list (if ``query``) and key-tile list (if ``key``), in that
    order, built once per offsets tensor: a model's layers all attend over one batch's offsets,
    so its forward builds the query list once a step (the first layer) and its backward the key
    list once (the query list is the forward's). What is missing is built in one launch. The
    lists live on the offsets tensor (an attribute) and are rebuilt when its contents change in
    place (its version counter) or the current stream changes."""
    kinds = [kind for kind, wanted in (("query", query), ("key", key)) if wanted]
    cache = _list_cache(offsets)
    if cache is None:
        return _build(offsets, max_seqlen, n_rows, query, key)
    missing = [kind for kind in kinds if (kind, max_seqlen, n_rows) not in cache]
    if missing:
        built = _build(offsets, max_seqlen, n_rows, "query" in missing, "key" in missing)
        for kind, lists in zip(missing, built):
            cache[(kind, max_seqlen, n_rows)] = lists
    return [cache[(kind, max_seqlen, n_rows)] for kind in kinds]


def work_list_reference(lengths: list[int], max_seqlen: int, from_end: bool) -> list[int]:
    """:func:`work_list`'s items (its first n_listed entries), by a plain loop."""
    B, n_levels = len(lengths), math.ceil(max_seqlen / TILE_ROWS)
    items = []
    for level in reversed(range(n_levels)):
        for b, length in enumerate(lengths):
            n_tiles = math.ceil(length / TILE_ROWS)
            if level < n_tiles:
                items.append((n_tiles - 1 - level if from_end else level) * B + b)
    return items
