"""FP8 all-gather of :class:`~gemcore.kernels.fp8_block.FP8BlockLinear` weights under FSDP2.

The same FSDP2 extension protocol as :mod:`gemcore.kernels.mx_fsdp` (``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` on the sharded parameter's local tensor), with 128x128 blocks:

* :class:`FP8BlockShardedWeight` wraps the float32 master weight (then its row shard) and acts
  as it (optimizer, ``copy_``, FSDP2's chunking). Its pre-all-gather casts the shard to 128x128
  blocks and sends the E4M3 elements (as ``uint8``: gloo has no float8) and one float32 scale per
  block: ``1 + 4/16384`` bytes an element instead of 2 (bf16). The cast is cached until the master
  shard changes, so it runs once per optimizer step.
* :class:`FP8BlockGatheredWeight` is the unsharded ``(out, in)`` parameter FSDP2 builds from the
  gathered bytes. ``FP8BlockLinear`` multiplies with it directly. The dgrad GEMM needs Wᵀ, whose
  128x128 blocks are the same blocks transposed: transposing the FP8 elements and the scales
  gives it, with no recast and nothing more communicated. So a gathered layer computes exactly
  what the unsharded layer computes.

A shard whose rows are not a multiple of 128, or a weight whose ``in_features`` is not, would
split or pad a block: such weights are gathered as their master shard in the parameter dtype and
cast after the gather (a plain gather).

``wrap_fp8_block_weights(model)`` wraps every FP8BlockLinear's weight; call it before
``fully_shard`` and before building the optimizer. ``state_dict()`` holds the plain master weights.
"""
from __future__ import annotations


import torch
from torch import nn

from gemcore.kernels.fp8_block import BLOCK, CAST_BACKENDS, BlockFP8, FP8BlockLinear, quantize_weight
from gemcore.kernels.mx_fsdp import MXGatheredWeight, MXShardedWeight, _plain_weight_hook


class FP8BlockShardedWeight(MXShardedWeight):
    """A float32 master weight (or its FSDP2 shard) whose FSDP2 all-gather sends 128x128-block FP8.

    ``master``: the plain tensor, ``(rows, in_features)``; ``cast_backend``: how the shard is cast.
    ``casts``: how many times it has cast its values (for tests and logs).
    """

    @staticmethod
    def __new__(cls, master: torch.Tensor, cast_backend: str = "auto"):
        return torch.Tensor._make_wrapper_subclass(
            cls, master.size(), strides=master.stride(), storage_offset=master.storage_offset(),
            dtype=master.dtype, layout=master.layout, device=master.device,
            requires_grad=master.requires_grad)

    def __init__(self, master: torch.Tensor, cast_backend: str = "auto"):
        if type(master) is not torch.Tensor:
            raise ValueError(f"master must be a plain torch.Tensor, got {type(master).__name__}")
        if cast_backend not in CAST_BACKENDS:
            raise ValueError(f"cast_backend must be one of {CAST_BACKENDS}, got {cast_backend!r}")
        self.master = master
        self.cast_backend = cast_backend
        self.casts = 0
        self._cached = None

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP8BlockShardedWeight({self.master!r})"

    def __tensor_flatten__(self):
        return ["master"], (self.cast_backend,)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8BlockShardedWeight(inner["master"], *ctx)

    def _rewrap(self, t: torch.Tensor) -> "FP8BlockShardedWeight":
        return FP8BlockShardedWeight(t, self.cast_backend)

    def _cast_master(self) -> BlockFP8:
        """The master shard in 128x128 blocks, (rows, in_features)."""
        return quantize_weight(self.master, transpose=False, backend=self.cast_backend)[0]

    def fp8_shard(self) -> BlockFP8:
        """:meth:`_cast_master`, cached until the master values change."""
        return self.mx_shard()

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 all-gathers: the FP8 elements as ``uint8`` (rows, K) and the float32 scales
        (rows/128, K/128) when every shard holds whole blocks; else the master shard padded to
        FSDP2's padded shard size in the mixed-precision parameter dtype."""
        shards = mesh.size()
        rows, cols = outer_size[0], outer_size[-1]
        if len(outer_size) == 2 and rows % (shards * BLOCK) == 0 and cols % BLOCK == 0:
            cast = self.fp8_shard()
            return (cast.data.view(torch.uint8), cast.scale), ("fp8",)
        return self._plain_all_gather_input(rows, shards, mp_policy)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter: ``(tensor, tensors FSDP2 frees)``, or None with ``out``."""
        if metadata[0] == "plain":
            (full,) = all_gather_outputs
            return None if out is not None else (full, ())
        data_u8, scale = all_gather_outputs
        if out is not None:
            if not (isinstance(out, FP8BlockGatheredWeight)
                    and out.mx.data.untyped_storage().data_ptr() == data_u8.untyped_storage().data_ptr()):
                raise RuntimeError("fsdp_post_all_gather: out does not view this all-gather's output")
            return None
        data = data_u8.view(torch.float8_e4m3fn)
        return FP8BlockGatheredWeight(data, scale, param_dtype), (data_u8, scale)


class FP8BlockGatheredWeight(MXGatheredWeight):
    """An unsharded ``(out, in)`` weight FSDP2 gathered in 128x128-block FP8: reports ``dtype``
    (the parameter dtype) and holds ``mx``, a :class:`BlockFP8`. Read-only; any other op runs on
    the exactly dequantized values and returns a plain tensor."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data, scale, dtype):
        self.mx = BlockFP8(data, scale, BLOCK)

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"FP8BlockGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.dtype,)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8BlockGatheredWeight(inner["_data"], inner["_scale"], *ctx)

    def _same(self) -> "FP8BlockGatheredWeight":
        return FP8BlockGatheredWeight(self.mx.data, self.mx.scale, self.dtype)

    def fp8_pair(self) -> tuple[BlockFP8, BlockFP8]:
        """(W (N, K), Wᵀ (K, N)) in 128x128 blocks: the transpose moves elements and scales only."""
        w = self.mx
        return w, BlockFP8(w.data.t().contiguous(), w.scale.t().contiguous(), BLOCK)


def wrap_fp8_block_weights(model: nn.Module) -> list[str]:
    """Wrap the plain 2-D weight of every :class:`FP8BlockLinear` in an FP8BlockShardedWeight
    (same storage), in place, before ``fully_shard`` and the optimizer. Returns the names of the
    layers whose weights are wrapped (now or before)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    done, new_params = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, FP8BlockLinear):
            continue
        weight = module.weight
        if isinstance(weight, FP8BlockShardedWeight):
            done.append(name)
            continue
        if type(weight) is not nn.Parameter or weight.dim() != 2:
            continue
        if id(weight) not in new_params:  # tied weights stay tied
            wrapped = FP8BlockShardedWeight(weight.data, module.fp8_config.cast)
            new_params[id(weight)] = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        module.weight = new_params[id(weight)]
        if not getattr(module, "_fp8_plain_state_dict", False):
            module._register_state_dict_hook(_plain_weight_hook)
            module._fp8_plain_state_dict = True
        done.append(name)
    return done


def fp8_block_gather_bytes(out_features: int, in_features: int, shards: int) -> int:
    """Bytes one rank sends per all-gather of an FP8-gathered ``(out, in)`` weight (0 where it
    falls back to a plain gather): its row shard's elements plus 4 bytes per 128x128 block."""
    if out_features % (shards * BLOCK) or in_features % BLOCK:
        return 0
    rows = out_features // shards
    return rows * in_features + 4 * (rows // BLOCK) * (in_features // BLOCK)


__all__ = ["FP8BlockShardedWeight", "FP8BlockGatheredWeight", "wrap_fp8_block_weights",
           "fp8_block_gather_bytes"]
