"""Block-scaled FP8 (DeepSeek-V3's recipe): casts, GEMM backends, ``FP8BlockLinear``.

```python
from gemcore.kernels import fp8_block as fb
x_rows, x_cols = fb.quantize_act(x)          # 1x128 blocks along K, and 128x1 blocks along tokens
w, w_t = fb.quantize_weight(w)               # 128x128 blocks, and the transpose (same scales)
y = fb.fp8_block_mm(x_rows, w, backend="cublas")   # x @ w^T: (M, N)
model = fb.convert_to_fp8_block(model, matmul="triton")
```

Semantics: :mod:`gemcore.kernels.fp8_block_reference` (power-of-two float32 scales, nothing
saturates). A :class:`BlockFP8` holds a 2-D E4M3 tensor whose blocks run along its last axis (the
GEMM's K) and its float32 scales. GEMMs take both operands K-last and compute ``a @ b^T`` with
float32 accumulation promoted once per 128-wide K block. Backends:

* ``"reference"``: dequantize (exact) and multiply in float32, any device;
* ``"cublas"``: torch's block-scaled ``torch._scaled_mm`` (cuBLAS, Hopper, CUDA >= 12.9);
* ``"scaled_mm"``: the same cuBLAS GEMM through ``torch.nn.functional.scaled_mm`` with
  ``ScalingType.BlockWise1x128`` / ``BlockWise128x128``;
* ``"triton"``: :func:`gemcore.kernels.fp8_block_triton.fp8_block_mm_triton`, FP8 tensor cores
  (compute capability >= 8.9);
* ``"auto"``: the reference off CUDA; on CUDA the first backend of the GPU's compute capability's
  row in :data:`AUTO_CUDA_MATMUL` that runs this GEMM here, and an error where no row is listed
  (``auto`` only picks kernels that have run and passed their tests on that GPU generation).

An explicitly requested backend that cannot run raises; nothing falls back to another backend.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import nn

from gemcore.kernels.fp8_block_reference import (BLOCK, dequantize_reference, fp8_block_mm_reference,
                                                 quantize_rows_reference, quantize_square_reference)

MATMUL_BACKENDS = ("auto", "reference", "cublas", "scaled_mm", "triton")
CAST_BACKENDS = ("auto", "triton", "reference")
#: compute capability -> the GEMM backends ``"auto"`` runs there, fastest first: only backends whose
#: GPU tests and benchmarks passed on that generation. Hopper (H100 and H200, torch 2.11): cuBLAS
#: through ``torch._scaled_mm``; where this torch's ``_scaled_mm`` cannot take a GEMM's 128x128
#: scale layout, the same cuBLAS GEMM through ``F.scaled_mm``; the Triton kernel where neither runs.
AUTO_CUDA_MATMUL: dict[tuple[int, int], tuple[str, ...]] = {(9, 0): ("cublas", "scaled_mm", "triton")}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _round_up(n: int, m: int = BLOCK) -> int:
    return -(-n // m) * m


@dataclass
class BlockFP8:
    """A block-scaled FP8 matrix, blocks along the last axis.

    ``data``: (R, C) ``torch.float8_e4m3fn``, contiguous, C a multiple of 128.
    ``scale``: float32 2^E per block: (R, C/128) for 1x128 blocks (``block_rows=1``, stored
    column-major: strides (1, R), the layout cuBLAS wants), (R/128, C/128) for 128x128 blocks
    (``block_rows=128``, row-major). Element times scale is the value.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block_rows: int

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(R, C) values in ``dtype`` (exact in float32, NaN for NaN blocks)."""
        return dequantize_reference(self.data, self.scale, dtype)


# --------------------------------------------------------------------------- validation
def _check_input(x, name: str, pad: bool) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES and x.dtype != torch.float64:
        raise ValueError(f"{name} must be float32/bfloat16/float16/float64 to cast to FP8, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(x.shape)}")
    if not pad and x.shape[1] % BLOCK:
        raise ValueError(f"{name}: the last dimension must be a multiple of {BLOCK} (the block), got "
                         f"shape {tuple(x.shape)}; pass pad=True to zero-pad to whole blocks")


def _cast_backend(x: torch.Tensor, backend: str, name: str) -> str:
    if backend not in CAST_BACKENDS:
        raise ValueError(f"backend must be one of {CAST_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda and x.dtype in _INPUT_DTYPES else "reference"
    if backend == "triton":
        if not (x.is_cuda or _interpreting()):
            raise ValueError(f"backend='triton' needs a CUDA tensor (or TRITON_INTERPRET=1), {name} is on {x.device}")
        if x.dtype not in _INPUT_DTYPES:
            raise ValueError(f"backend='triton' casts float32/bfloat16/float16, {name} is {x.dtype}")
        _require_fp8_gpu(x.device, "the FP8 cast")
    return backend


def _require_fp8_gpu(device: torch.device, what: str) -> None:
    """Raise unless ``device`` is a CPU under the interpreter or a GPU with FP8 (sm >= 8.9)."""
    if device.type != "cuda":
        return
    cap = _capability(device)
    if cap < (8, 9):
        raise ValueError(f"{what} needs a GPU with FP8 tensor cores (compute capability >= 8.9); "
                         f"{torch.cuda.get_device_name(device)} has {cap[0]}.{cap[1]}")


#: compute capability by CUDA device index (a plain dict: torch.compile traces a lookup in it)
_CAPABILITIES: dict[int, tuple[int, int]] = {}


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _capability(device: torch.device) -> tuple[int, int]:
    index = _device_index(device)
    if index not in _CAPABILITIES:
        _CAPABILITIES[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITIES[index]


def _padded(x: torch.Tensor, r_pad: int, c_pad: int) -> torch.Tensor:
    R, C = x.shape
    if (R, C) == (r_pad, c_pad):
        return x
    return torch.nn.functional.pad(x, (0, c_pad - C, 0, r_pad - R))


def _col_major(scale: torch.Tensor) -> torch.Tensor:
    """(R, n) -> the same values with strides (1, R)."""
    return scale.t().contiguous().t()


# --------------------------------------------------------------------------- casts
def quantize_rows(x: torch.Tensor, *, pad: bool = False, backend: str = "auto") -> BlockFP8:
    """x (R, C) -> 1x128 blocks along C. ``pad``: zero-pad C (and R) to multiples of 128
    (else C must be one). R is padded to a multiple of 128 whenever ``pad`` is set."""
    _check_input(x, "x", pad)
    backend = _cast_backend(x, backend, "x")
    R, C = x.shape
    r_pad, c_pad = (_round_up(R), _round_up(C)) if pad else (R, C)
    if backend == "reference":
        data, scale = quantize_rows_reference(_padded(x, r_pad, c_pad))
        return BlockFP8(data, _col_major(scale), 1)
    from gemcore.kernels.fp8_block_triton import cast_triton

    scale = torch.empty((c_pad // BLOCK, r_pad), dtype=torch.float32, device=x.device).t()
    data, _ = cast_triton(x, r_pad, c_pad, rows=True, cols=False, square=False, rscale=scale, cscale=None)
    return BlockFP8(data, scale, 1)


def quantize_act(x: torch.Tensor, *, backend: str = "auto") -> tuple[BlockFP8, BlockFP8]:
    """x (M, K) -> (1x128 blocks along K: (Mp, Kp), 128x1 blocks along M transposed: (Kp, Mp)),
    both from one read on CUDA; Mp, Kp = M, K rounded up to multiples of 128 (zero rows and
    columns). The first feeds forward/dgrad GEMMs, the second the wgrad GEMM."""
    _check_input(x, "x", True)
    backend = _cast_backend(x, backend, "x")
    M, K = x.shape
    m_pad, k_pad = _round_up(M), _round_up(K)
    if backend == "reference":
        xp = _padded(x, m_pad, k_pad)
        rd, rs = quantize_rows_reference(xp)
        cd, cs = quantize_rows_reference(xp.t())
        return BlockFP8(rd, _col_major(rs), 1), BlockFP8(cd, _col_major(cs), 1)
    from gemcore.kernels.fp8_block_triton import cast_triton

    rs = torch.empty((k_pad // BLOCK, m_pad), dtype=torch.float32, device=x.device).t()
    cs = torch.empty((m_pad // BLOCK, k_pad), dtype=torch.float32, device=x.device).t()
    rd, cd = cast_triton(x, m_pad, k_pad, rows=True, cols=True, square=False, rscale=rs, cscale=cs)
    return BlockFP8(rd, rs, 1), BlockFP8(cd, cs, 1)


def quantize_weight(w: torch.Tensor, *, transpose: bool = True, pad: bool = False,
                    backend: str = "auto") -> tuple[BlockFP8, Optional[BlockFP8]]:
    """w (N, K) -> (128x128 blocks: (N, K), and with ``transpose`` w^T (K, N) with the same
    blocks' scales transposed), one read on CUDA. Without ``pad`` N and K must be multiples of 128."""
    _check_input(w, "w", pad)
    if not pad and w.shape[0] % BLOCK:
        raise ValueError(f"w: the first dimension must be a multiple of {BLOCK} (the block), got "
                         f"shape {tuple(w.shape)}; pass pad=True to zero-pad to whole blocks")
    backend = _cast_backend(w, backend, "w")
    n_pad, k_pad = _round_up(w.shape[0]), _round_up(w.shape[1])
    if backend == "reference":
        data, scale = quantize_square_reference(_padded(w, n_pad, k_pad))
        wt = BlockFP8(data.t().contiguous(), scale.t().contiguous(), BLOCK) if transpose else None
        return BlockFP8(data, scale, BLOCK), wt
    from gemcore.kernels.fp8_block_triton import cast_triton

    scale = torch.empty((n_pad // BLOCK, k_pad // BLOCK), dtype=torch.float32, device=w.device)
    data, data_t = cast_triton(w, n_pad, k_pad, rows=False, cols=transpose, square=True, rscale=scale,
                               cscale=None)
    wt = BlockFP8(data_t, scale.t().contiguous(), BLOCK) if transpose else None
    return BlockFP8(data, scale, BLOCK), wt


# --------------------------------------------------------------------------- GEMM
def cublas_block_scaling() -> Optional[str]:
    """None when this torch and GPU run cuBLAS's 1x128 / 128x128 block-scaled FP8 GEMM, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    cuda = torch.version.cuda or "0.0"
    if tuple(int(p) for p in cuda.split(".")[:2]) < (12, 9):
        return f"cuBLAS block scaling needs CUDA >= 12.9, torch is built with {cuda}"
    cap = _capability(torch.device("cuda", torch.cuda.current_device()))
    if cap != (9, 0):
        return f"cuBLAS 1x128/128x128 block scaling runs on compute capability 9.0, this GPU is {cap[0]}.{cap[1]}"
    return None


def functional_block_scaling() -> Optional[str]:
    """None when ``torch.nn.functional.scaled_mm`` takes 1x128 / 128x128 recipes here, else why not."""
    F = torch.nn.functional
    if not hasattr(F, "scaled_mm") or not hasattr(getattr(F, "ScalingType", None), "BlockWise1x128"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128"
    return cublas_block_scaling()


def matmul_backend_status(device: torch.device) -> dict[str, Optional[str]]:
    """Each GEMM backend -> None if it can run on ``device``, else the reason it cannot."""
    device = torch.device(device)
    status: dict[str, Optional[str]] = {"reference": None}
    if device.type != "cuda":
        status["cublas"] = status["scaled_mm"] = "needs a CUDA GPU"
        status["triton"] = None if _interpreting() else "needs a CUDA GPU (or TRITON_INTERPRET=1)"
        return status
    cap = _capability(device)
    status["cublas"] = cublas_block_scaling()
    status["scaled_mm"] = functional_block_scaling()
    status["triton"] = None if cap >= (8, 9) else f"needs FP8 tensor cores (sm >= 8.9), this GPU is {cap[0]}.{cap[1]}"
    return status


def resolve_matmul_backend(backend: str, device: torch.device, square_blocks: tuple[int, int] | None = None) -> str:
    """The backend that runs for ``backend`` on ``device``; raises if it cannot run there.

    ``square_blocks``: (N/128, K/128) of the GEMM's 128x128 operand, if it has one: ``auto``
    then skips ``cublas`` where this torch cannot pass that operand's scales to cuBLAS.
    """
    if backend not in MATMUL_BACKENDS:
        raise ValueError(f"backend must be one of {MATMUL_BACKENDS}, got {backend!r}")
    device = torch.device(device)
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        cap = _capability(device)
        if cap not in AUTO_CUDA_MATMUL:
            raise ValueError(f"matmul='auto': no block-scaled FP8 GEMM has been verified on compute "
                             f"capability {cap[0]}.{cap[1]}; choose 'cublas', 'scaled_mm' or 'triton' (or 'reference') "
                             f"explicitly (see docs/fp8.md)")
        key = (_device_index(device), square_blocks)
        if key in _AUTO_CHOICES:
            return _AUTO_CHOICES[key]
        _AUTO_CHOICES[key] = chosen = _first_runnable(AUTO_CUDA_MATMUL[cap], device, square_blocks)
        return chosen
    reason = matmul_backend_status(device)[backend]
    if reason is not None:
        raise ValueError(f"matmul backend {backend!r} cannot run on {device}: {reason}")
    return backend


#: (CUDA device index, 128x128 operand's blocks or None) -> the backend ``auto`` chose there
_AUTO_CHOICES: dict[tuple[int, tuple[int, int] | None], str] = {}


def _first_runnable(candidates: tuple[str, ...], device: torch.device,
                    square_blocks: tuple[int, int] | None) -> str:
    """The first of ``candidates`` that runs a GEMM with these 128x128 blocks on ``device``."""
    status = matmul_backend_status(device)
    for candidate in candidates:
        if status[candidate] is not None:
            continue
        if candidate == "cublas" and square_blocks is not None and not cublas_takes_block_scales(
                square_blocks[1], square_blocks[0], device):
            continue
        return candidate
    raise ValueError(f"matmul='auto': none of {', '.join(candidates)} runs on {device}: "
                     + "; ".join(f"{name}: {status[name]}" for name in candidates if status[name] is not None))


def fp8_block_mm(a: BlockFP8, b: BlockFP8, out_dtype: torch.dtype = torch.bfloat16,
                 backend: str = "auto") -> torch.Tensor:
    """``a.dequantize() @ b.dequantize().T`` with float32 accumulation promoted per 128-wide K block.

    a: (M, K) in 1x128 blocks; b: (N, K) in 1x128 or 128x128 blocks. -> (M, N) ``out_dtype``.
    """
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, BlockFP8):
            raise ValueError(f"{name} must be a BlockFP8, got {type(t).__name__}")
    if a.block_rows != 1:
        raise ValueError(f"a must be in 1x128 blocks, got {a.block_rows}x128")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"a and b disagree on K: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}")
    if a.data.device != b.data.device:
        raise ValueError(f"a and b must be on one device, got {a.data.device} and {b.data.device}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"out_dtype must be float32/bfloat16/float16, got {out_dtype!r}")
    square = tuple(b.scale.shape) if b.block_rows == BLOCK else None
    backend = resolve_matmul_backend(backend, a.data.device, square)
    if backend == "reference":
        return fp8_block_mm_reference(a.data, a.scale, b.data, b.scale, out_dtype)
    M, N = a.data.shape[0], b.data.shape[0]
    if M == 0 or N == 0 or a.data.shape[1] == 0:  # (an empty batch's wgrad contracts over 0 tokens)
        return torch.zeros((M, N), dtype=out_dtype, device=a.data.device)
    if backend == "triton":
        from gemcore.kernels.fp8_block_triton import fp8_block_mm_triton

        return fp8_block_mm_triton(a.data, a.scale, b.data, b.scale, b.block_rows, out_dtype)
    if backend == "scaled_mm":
        return _functional_mm(a, b, out_dtype)
    return _cublas_mm(a, b, out_dtype)


def _padded_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """128x128 scales (N/128, K/128) -> (L4, N/128) column-major, K/128 zero-padded to L4, a
    multiple of 4: the 16-byte aligned leading dimension cuBLAS's 128x128 block scaling reads."""
    nb, kb = scale.shape
    l4 = -(-kb // 4) * 4
    if l4 == kb and scale.stride() == (kb, 1):
        return scale.t()
    padded = torch.zeros((nb, l4), dtype=torch.float32, device=scale.device)
    padded[:, :kb] = scale
    return padded.t()


#: CUDA device index -> whether this torch's ``_scaled_mm`` takes 128x128 scales with a padded
#: leading dimension (newer torch); older releases check for exactly K/128, which cuBLAS misreads
#: unless K/128 is a multiple of 4
_PADDED_128_SCALES: dict[int, bool] = {}


def _cublas_takes_padded_scales(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes padded 128x128 scales on ``device`` (asked once; meta
    tensors get the padded layout, the one current torch checks for)."""
    if device.type != "cuda":
        return True
    index = _device_index(device)
    if index not in _PADDED_128_SCALES:
        _probe_padded_scales(device, index)
    return _PADDED_128_SCALES[index]


@torch.compiler.disable  # a real call: its argument check runs on the host, before any launch
def _probe_padded_scales(device: torch.device, index: int) -> None:
    if index not in _PADDED_128_SCALES:
        a = torch.zeros((128, 256), device=device).to(torch.float8_e4m3fn)
        b = torch.zeros((256, 256), device=device).to(torch.float8_e4m3fn)
        scale_a = torch.ones((2, 128), device=device).t()  # (128, 2) column-major
        scale_b = torch.ones((2, 4), device=device).t()[:2]  # (2, 2), stride (1, 4)
        try:
            torch._scaled_mm(a, b.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
            _PADDED_128_SCALES[index] = True
        except RuntimeError:
            _PADDED_128_SCALES[index] = False


def cublas_takes_block_scales(k_blocks: int, n_blocks: int, device: torch.device) -> bool:
    """Whether ``matmul="cublas"`` runs a GEMM whose 128x128 operand has ``n_blocks`` x
    ``k_blocks`` blocks (K contracted) on ``device``: always where torch takes padded scales;
    on older torch only with an aligned leading dimension (K/128 a multiple of 4) or a single
    column of blocks."""
    return _cublas_takes_padded_scales(torch.device(device)) or k_blocks % 4 == 0 or n_blocks == 1


def _cublas_mm(a: BlockFP8, b: BlockFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """torch._scaled_mm with a's 1x128 scales (M, K/128) column-major and b^T's scales:
    (K/128, N/128) column-major for 128x128 blocks (leading dimension padded to a multiple of 4
    where this torch takes it), (K/128, N) row-major for 1x128 blocks."""
    scale_b = b.scale.t()
    if b.block_rows == BLOCK:
        nb, kb = b.scale.shape
        if not cublas_takes_block_scales(kb, nb, b.scale.device):
            raise ValueError(
                f"matmul='cublas': torch {torch.__version__}'s _scaled_mm takes 128x128 scales only when "
                f"the contracted dimension is a multiple of {4 * BLOCK} (cuBLAS needs a 16-byte aligned "
                f"scale layout), got K = {b.data.shape[1]}; use matmul='scaled_mm' or 'triton' for this shape")
        if _cublas_takes_padded_scales(b.scale.device):
            scale_b = _padded_block_scales(b.scale)[:kb]  # stride (1, L4)
        elif scale_b.stride(0) != 1:
            scale_b = _col_major(scale_b)
    return torch._scaled_mm(a.data, b.data.t(), scale_a=a.scale, scale_b=scale_b, out_dtype=out_dtype)


def _functional_mm(a: BlockFP8, b: BlockFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """torch.nn.functional.scaled_mm: a's scales (M, K/128) column-major; b's 128x128 scales as
    (L4, N/128) column-major with K/128 padded to L4 = a multiple of 4, or b's 1x128 scales
    (N, K/128) column-major."""
    F = torch.nn.functional
    if b.block_rows == BLOCK:
        scale_b, recipe_b = _padded_block_scales(b.scale), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = b.scale, F.ScalingType.BlockWise1x128
    return F.scaled_mm(a.data, b.data.t(), a.scale, F.ScalingType.BlockWise1x128, scale_b, recipe_b,
                       output_dtype=out_dtype)


# --------------------------------------------------------------------------- GPU generations
#: what each GPU generation gets for low-precision training (compute capability, name, routes)
GENERATIONS = [
    ((8, 0), "Ampere and older (no FP8 tensor cores)",
     "mxfp8 exact (bf16 GEMMs on dequantized operands); fp8_block fast paths refused"),
    ((8, 9), "Ada",
     "fp8_block matmul=triton (FP8 tensor cores); cuBLAS block scaling is Hopper-only"),
    ((9, 0), "Hopper",
     "fp8_block matmul=cublas (cuBLAS 1x128/128x128, CUDA >= 12.9) or matmul=triton; mxfp8 exact"),
    ((10, 0), "Blackwell (data centre)",
     "mxfp8 with tl.dot_scaled, the native MX block-scaled MMA (mx_matmul backend triton_scaled, "
     "by name: compiled for sm_100 ahead of time, not yet run on a Blackwell GPU, so mxfp8's auto "
     "stays on the exact path); fp8_block matmul=triton"),
]


def generation_of(capability: tuple[int, int]) -> tuple[int, int]:
    """The :data:`GENERATIONS` row a GPU of ``capability`` falls in (the last one not above it)."""
    return max((cap for cap, _, _ in GENERATIONS if cap <= capability), default=GENERATIONS[0][0])


def generation_routes() -> list[tuple[str, str, str]]:
    """(compute capability, generation, routes) rows, with what ``fp8_block``'s ``auto`` picks."""
    rows = []
    for cap, name, routes in GENERATIONS:
        auto = AUTO_CUDA_MATMUL.get(cap)
        auto_note = (f"auto -> {', then '.join(auto)} (the first that runs the GEMM)" if auto
                     else "auto: none verified on this generation, choose explicitly")
        rows.append((f"{cap[0]}.{cap[1]}", name, f"{routes}; fp8_block {auto_note}"))
    return rows


# --------------------------------------------------------------------------- FP8BlockLinear
@dataclass(frozen=True)
class FP8BlockConfig:
    """How an :class:`FP8BlockLinear` computes: ``matmul`` backend of its three GEMMs and
    ``cast`` backend of its casts."""

    matmul: str = "auto"
    cast: str = "auto"

    def __post_init__(self):
        if self.matmul not in MATMUL_BACKENDS:
            raise ValueError(f"matmul must be one of {MATMUL_BACKENDS}, got {self.matmul!r}")
        if self.cast not in CAST_BACKENDS:
            raise ValueError(f"cast must be one of {CAST_BACKENDS}, got {self.cast!r}")


def _weight_pair(weight: torch.Tensor, cfg: FP8BlockConfig) -> tuple[BlockFP8, BlockFP8]:
    """(W, Wᵀ) in 128x128 blocks: as FSDP2 gathered them in FP8 (no cast), else cast from the
    master values (zero-padded to whole blocks)."""
    from gemcore.kernels.fp8_block_fsdp import FP8BlockGatheredWeight, FP8BlockShardedWeight

    if isinstance(weight, FP8BlockGatheredWeight):
        return weight.fp8_pair()
    if isinstance(weight, FP8BlockShardedWeight):
        weight = weight.master
    return quantize_weight(weight.detach(), pad=True, backend=cfg.cast)


def layer_gemm_keys(weight_shape: tuple[int, int]) -> list[tuple[int, int] | None]:
    """The 128x128 operands' blocks of a linear layer's three GEMMs, as ``auto`` keys its choices:
    forward (W: (N/128, K/128), padded), dgrad (Wᵀ: (K/128, N/128)), wgrad (None: 1x128 only)."""
    n_blocks, k_blocks = -(-weight_shape[0] // BLOCK), -(-weight_shape[1] // BLOCK)
    return [(n_blocks, k_blocks), (k_blocks, n_blocks), None]


def learn_device(device: torch.device, matmul: str, weight_shape: tuple[int, int]) -> None:
    """Ask a CUDA ``device`` now what an FP8 layer of ``weight_shape`` (N, K) will need: its compute
    capability, cuBLAS's scale layout and, for ``matmul="auto"`` on a generation ``auto`` covers,
    the backend of each of its three GEMMs. The answers are cached, so a compiled graph reads
    them; asked while torch.compile traces, the probes would break the graph at every layer."""
    cap = _capability(device)
    _cublas_takes_padded_scales(device)
    if matmul == "auto" and cap in AUTO_CUDA_MATMUL:
        for key in layer_gemm_keys(weight_shape):
            resolve_matmul_backend("auto", device, key)


class _FP8BlockLinearFunction(torch.autograd.Function):
    """out = x W^T with every GEMM in block-scaled FP8.

    forward: x (M, K) in 1x128 blocks times W (N, K) in 128x128 blocks. dgrad dx = dy W: dy (M, N)
    in 1x128 blocks times W^T (K, N) in 128x128 blocks (the same blocks' scales transposed).
    wgrad dW = dy^T x: dy^T (N, M) and x^T (K, M) in 1x128 blocks along tokens. x and dy are each
    cast once into both layouts, W once into both; saved for backward: x^T's FP8 (1 byte an
    element) and W^T's FP8. Shapes not multiples of 128 are zero-padded inside the FP8 copies.
    """

    @staticmethod
    def forward(ctx, x, weight, cfg: FP8BlockConfig, out_dtype: torch.dtype):
        M, K = x.shape
        N = weight.shape[0]
        x_rows, x_cols = quantize_act(x, backend=cfg.cast)
        w, w_t = _weight_pair(weight, cfg)
        out = fp8_block_mm(x_rows, w, out_dtype, cfg.matmul)
        ctx.save_for_backward(x_cols.data, x_cols.scale, w_t.data, w_t.scale)
        ctx.cfg, ctx.shape, ctx.x_dtype, ctx.w_dtype = cfg, (M, K, N), x.dtype, weight.dtype
        return out[:M, :N]

    @staticmethod
    def backward(ctx, dy):
        cfg = ctx.cfg
        M, K, N = ctx.shape
        xc_data, xc_scale, wt_data, wt_scale = ctx.saved_tensors
        dy_rows, dy_cols = quantize_act(dy, backend=cfg.cast)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_block_mm(dy_rows, BlockFP8(wt_data, wt_scale, BLOCK), ctx.x_dtype, cfg.matmul)[:M, :K]
        if ctx.needs_input_grad[1]:
            dw = fp8_block_mm(dy_cols, BlockFP8(xc_data, xc_scale, 1), ctx.w_dtype, cfg.matmul)[:N, :K]
            dw = dw.contiguous()
        return dx, dw, None, None


def check_fp8_input(x: torch.Tensor, in_features: int, weights: list, module: str, tp_hint: str) -> torch.dtype:
    """Raise ValueError naming the problem unless ``x`` (..., in_features) can be cast to FP8 and
    neither ``x`` nor ``weights`` is a DTensor (tensor parallelism); returns the output dtype: the
    autocast dtype when autocast is on for x's device, else x's dtype."""
    if x.shape[-1] != in_features:
        raise ValueError(f"x: last dimension must be in_features={in_features}, got {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"x must be float32/bfloat16/float16 to cast to FP8, got {x.dtype}")
    from gemcore.kernels.mx import _is_dtensor

    if _is_dtensor(x) or any(_is_dtensor(w) for w in weights):
        raise ValueError(f"{module} does not run under tensor parallelism (a weight or x is a DTensor); {tp_hint}")
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


class FP8BlockLinear(nn.Linear):
    """Drop-in ``nn.Linear`` whose forward, dgrad and wgrad GEMMs run in block-scaled FP8.

    Master weight and bias keep their dtype (float32 in training). Output dtype: the autocast dtype
    when autocast is on for the input's device, else the input's dtype. Keyword options:
    ``matmul``, ``cast`` (see :class:`FP8BlockConfig`).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None,
                 **options):
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.fp8_config = FP8BlockConfig(**options)

        self._learn_device()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options) -> "FP8BlockLinear":
        """An FP8BlockLinear sharing ``linear``'s parameters (no copy; optimizer state stays valid)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new.fp8_config = FP8BlockConfig(**options)
        new._learn_device()
        return new

    def _apply(self, fn, *args, **kwargs):
        module = super()._apply(fn, *args, **kwargs)
        self._learn_device()
        return module

    def _learn_device(self) -> None:
        """Ask the weight's CUDA device, eagerly, what the GEMM backends need to know
        (:func:`learn_device`), so torch.compile later reads cached answers."""
        weight = getattr(self, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.is_cuda:
            learn_device(weight.device, self.fp8_config.matmul, tuple(weight.shape))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out_dtype = check_fp8_input(x, self.in_features, [self.weight], "FP8BlockLinear",
                                    "use precision.impl=mxfp8 or bf16 for tp > 1 plans")
        device_type = x.device.type
        lead = x.shape[:-1]
        with torch.autocast(device_type, enabled=False):
            out = _FP8BlockLinearFunction.apply(x.reshape(-1, self.in_features), self.weight,
                                                self.fp8_config, out_dtype)
            out = out.reshape(*lead, self.out_features)
            if self.bias is not None:
                out = out + self.bias.to(out_dtype)
        return out

    def extra_repr(self) -> str:
        c = self.fp8_config
        return f"{super().extra_repr()}, matmul={c.matmul}, cast={c.cast}"


def convert_to_fp8_block(module: nn.Module, filter_fn: Optional[Callable[[nn.Module, str], bool]] = None,
                         **options) -> nn.Module:
    """Swap every ``nn.Linear`` in ``module`` for an :class:`FP8BlockLinear` sharing its parameters.

    ``filter_fn(linear, fqn) -> bool`` picks which layers convert (default: all). In place; returns
    ``module`` (or the new layer when ``module`` itself is a converted Linear).
    """
    FP8BlockConfig(**options)
    if filter_fn is not None and not callable(filter_fn):
        raise ValueError(f"filter_fn must be callable or None, got {type(filter_fn).__name__}")

    def wanted(linear: nn.Module, fqn: str) -> bool:
        return type(linear) is nn.Linear and (filter_fn is None or filter_fn(linear, fqn))

    if wanted(module, ""):
        return FP8BlockLinear.from_linear(module, **options)
    for fqn, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            child_fqn = f"{fqn}.{child_name}" if fqn else child_name
            if wanted(child, child_fqn):
                setattr(parent, child_name, FP8BlockLinear.from_linear(child, **options))
    return module


__all__ = ["BlockFP8", "FP8BlockConfig", "FP8BlockLinear", "quantize_rows", "quantize_act",
           "quantize_weight", "fp8_block_mm", "convert_to_fp8_block", "matmul_backend_status", "functional_block_scaling",
           "resolve_matmul_backend", "cublas_block_scaling", "cublas_takes_block_scales", "generation_routes", "generation_of", "MATMUL_BACKENDS", "CAST_BACKENDS", "BLOCK"]
