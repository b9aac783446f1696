"""MX all-gather of :class:`~gemcore.kernels.mx.MXLinear` weights under FSDP2.

FSDP2 (``torch.distributed.fsdp.fully_shard``) lets the local tensor of a sharded parameter take
over its all-gather: when that tensor has ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``,
FSDP2 all-gathers what the first returns and hands the gathered tensors to the second, which
builds the unsharded parameter. Two tensor subclasses use that here:

* :class:`MXShardedWeight` wraps the high-precision master weight (then its shard). It behaves
  as the plain tensor it holds (optimizer updates, ``copy_``, FSDP2's chunking and padding all
  reach the master values); its pre-all-gather MX-casts the shard along ``in_features`` (blocks
  of 32 along K, so FSDP2's row sharding along ``out_features`` never splits a block) and sends
  the FP8 elements (viewed as ``uint8``: gloo has no float8 dtypes) and the E8M0 scale bytes:
  ``1 + 1/32`` bytes an element instead of 2 (bf16) or 4 (float32). The cast is cached and
  redone only after the master shard changes (its version counter, or any in-place op through
  the wrapper), so it happens once per optimizer step however often FSDP2 gathers.
* :class:`MXGatheredWeight` is the unsharded parameter FSDP2 builds from the gathered bytes:
  an ``(out_features, in_features)`` tensor that reports the parameter dtype and holds the MX
  form. ``MXLinear`` multiplies with it directly (no cast in the forward); its backward
  recasts the dgrad orientation (blocks along ``out_features``) from the gathered weight,
  dequantized exactly, so nothing more is communicated. The gradient flows to it as a plain
  tensor, and FSDP2 reduce-scatters it onto the master shard (straight-through, as MXLinear
  does without FSDP).

Layers whose ``out_features`` the shard count does not divide (FSDP2 pads uneven shards, and its
extension protocol then asks every gathered tensor to have the padded shard's shape, which the
scale tensor cannot) fall back to gathering the master weight in the parameter dtype; MXLinear
casts it after the gather, as without this module.

``wrap_mx_weights(model)`` turns every MXLinear's plain weight into an MXShardedWeight; call it
before ``fully_shard``. ``state_dict()`` of a wrapped model (sharded or not) holds the plain
master weights. See docs/mx.md ("MX all-gather under FSDP2").
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

from gemcore.kernels.mx import MXConfig, MXLinear, MXTensor, _is_dtensor, quantize_mx
from gemcore.kernels.mx_reference import BLOCK, FORMATS

aten = torch.ops.aten

#: ops whose tensor results stay MXShardedWeight (views, copies, FSDP2's sharding and padding);
#: every other op sees the plain master values and returns plain tensors (optimizer state too)
_KEEP_WRAPPED = {
    aten.detach.default, aten.alias.default, aten.view.default, aten._unsafe_view.default,
    aten.as_strided.default, aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default,
    aten.clone.default, aten._to_copy.default, aten.copy_.default, aten.new_zeros.default,
    aten.new_empty.default, aten.new_empty_strided.default, aten.empty_like.default,
    aten._pin_memory.default,
}  # (chunk, narrow and contiguous decompose into these before reaching the subclass)


def _mutated_args(func, args, kwargs) -> list[Any]:
    """The arguments ``func`` writes to (by its schema)."""
    written = []
    schema = func._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            written.extend(value if isinstance(value, (list, tuple)) else [value])
    return written


class MXShardedWeight(torch.Tensor):
    """A high-precision master weight (or its FSDP2 shard) whose FSDP2 all-gather sends MX.

    ``master``: the plain tensor, ``(rows, in_features)``; ``elem``, ``scale_rule``,
    ``cast_backend``: how the shard is cast (from the layer's :class:`MXConfig`).
    ``casts``: how many times this tensor has MX-cast its values (for tests and logs).
    """

    master: torch.Tensor

    @staticmethod
    def __new__(cls, master: torch.Tensor, elem: str = "e4m3", scale_rule: str = "rceil",
                cast_backend: str = "auto"):
        return torch.Tensor._make_wrapper_subclass(
            cls, master.size(), strides=master.stride(), storage_offset=master.storage_offset(),
            dtype=master.dtype, layout=master.layout, device=master.device,
            requires_grad=master.requires_grad)

    def __init__(self, master: torch.Tensor, elem: str = "e4m3", scale_rule: str = "rceil",
                 cast_backend: str = "auto"):
        if type(master) is not torch.Tensor:
            raise ValueError(f"master must be a plain torch.Tensor, got {type(master).__name__}")
        MXConfig(elem=elem, scale_rule=scale_rule, cast_backend=cast_backend)  # validates
        self.master = master
        self.elem, self.scale_rule, self.cast_backend = elem, scale_rule, cast_backend
        self.casts = 0
        self._cached: tuple[tuple[int, int], MXTensor] | None = None

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"MXShardedWeight({self.master!r}, elem={self.elem}, scale_rule={self.scale_rule})"

    # ------------------------------------------------------------------ subclass plumbing
    def __tensor_flatten__(self):
        return ["master"], (self.elem, self.scale_rule, self.cast_backend)

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return MXShardedWeight(inner["master"], *ctx)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        like = next(t for t in tree_leaves((args, kwargs)) if isinstance(t, MXShardedWeight))
        for written in _mutated_args(func, args, kwargs):
            if isinstance(written, MXShardedWeight):
                written._cached = None
        wrappers = {}

        def unwrap(t: "MXShardedWeight") -> torch.Tensor:
            wrappers[id(t.master)] = t
            return t.master

        out = func(*tree_map_only(MXShardedWeight, unwrap, args),
                   **tree_map_only(MXShardedWeight, unwrap, kwargs))
        keep = func in _KEEP_WRAPPED

        def rewrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in wrappers:  # an in-place op returned its (wrapped) input
                return wrappers[id(t)]
            if keep:
                return like._rewrap(t)
            return t

        return tree_map(rewrap, out)

    def _rewrap(self, t: torch.Tensor) -> "MXShardedWeight":
        """``t`` (a view or copy of the master) wrapped like this tensor."""
        return MXShardedWeight(t, self.elem, self.scale_rule, self.cast_backend)

    def _cast_master(self) -> MXTensor:
        """The master values MX-cast along the last axis (in_features)."""
        return quantize_mx(self.master, elem=self.elem, axis=-1, scale_rule=self.scale_rule,
                           backend=self.cast_backend)

    # ------------------------------------------------------------------ the MX form of the shard
    def mx_shard(self) -> MXTensor:
        """The master values MX-cast along the last axis (in_features), cached until they change."""
        key = (self.master._version, self.master.data_ptr())
        if self._cached is None or self._cached[0] != key:
            with torch.no_grad():
                cast = self._cast_master()
            self.casts += 1
            self._cached = (key, cast)
        return self._cached[1]

    # ------------------------------------------------------------------ FSDP2 extension protocol
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """What FSDP2 all-gathers for this shard: ``(inputs, metadata)``.

        Rows split evenly over the shard mesh: the MX elements as ``uint8`` (rows, K) and the
        scale bytes (rows, ceil(K/32)). Otherwise the master shard padded to FSDP2's padded
        shard size, in the mixed-precision parameter dtype (a plain gather).
        """
        shards = mesh.size()
        rows = outer_size[0]
        if len(outer_size) == 2 and rows % shards == 0:
            cast = self.mx_shard()
            return (cast.data.view(torch.uint8), cast.scale), ("mx",)
        return self._plain_all_gather_input(rows, shards, mp_policy)

    def _plain_all_gather_input(self, rows: int, shards: int, mp_policy):
        """The master shard padded to FSDP2's padded shard size (``ceil(rows / shards)`` rows) in
        the mixed-precision parameter dtype: what a plain gather sends."""
        dtype = getattr(mp_policy, "param_dtype", None) or self.dtype
        padded = self.master.new_zeros((math.ceil(rows / shards), *self.master.shape[1:]), dtype=dtype)
        padded[: self.master.shape[0]].copy_(self.master)
        return (padded,), ("plain",)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter from the gathered tensors: ``(tensor, tensors FSDP2 frees)``,
        or nothing with ``out`` (FSDP2 refilled the storage ``out`` already views)."""
        if metadata[0] == "plain":
            (full,) = all_gather_outputs
            if out is not None:
                return None
            return full, ()
        data_u8, scale = all_gather_outputs
        if out is not None:
            out = getattr(out, "_local_tensor", out)      # under tensor parallelism: the DTensor's local
            if not (isinstance(out, MXGatheredWeight)
                    and out.mx.data.untyped_storage().data_ptr() == data_u8.untyped_storage().data_ptr()):
                raise RuntimeError("fsdp_post_all_gather: out does not view this all-gather's output")
            return None
        data = data_u8.view(FORMATS[self.elem].dtype)
        return MXGatheredWeight(data, scale, self.elem, self.scale_rule, param_dtype), (data_u8, scale)


class MXGatheredWeight(torch.Tensor):
    """An unsharded ``(out_features, in_features)`` weight that FSDP2 gathered in MX form.

    Reports ``dtype`` (the parameter dtype) and the full shape; ``mx`` holds the elements and
    scales blocked along in_features. Read-only: any op other than detach/alias/the identity
    ``as_strided`` runs on the dequantized values (exact) and returns a plain tensor.
    """

    mx: MXTensor

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, elem: str, scale_rule: str,
                dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, data.size(), dtype=dtype, device=data.device,
                                                   requires_grad=False)

    def __init__(self, data, scale, elem, scale_rule, dtype):
        self.mx = MXTensor(data, scale, elem, BLOCK, 1, scale_rule)

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"MXGatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, elem={self.mx.elem}, "
                f"scale_rule={self.mx.scale_rule})")

    def __tensor_flatten__(self):
        return ["_data", "_scale"], (self.mx.elem, self.mx.scale_rule, self.dtype)

    @property
    def _data(self):
        return self.mx.data

    @property
    def _scale(self):
        return self.mx.scale

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return MXGatheredWeight(inner["_data"], inner["_scale"], *ctx)

    __torch_function__ = torch._C._disabled_torch_function_impl

    def _same(self) -> "MXGatheredWeight":
        return MXGatheredWeight(self.mx.data, self.mx.scale, self.mx.elem, self.mx.scale_rule, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            return args[0]._same()
        if func is aten.as_strided.default:
            t, size, stride = args[0], tuple(args[1]), tuple(args[2])
            offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
            if size == tuple(t.shape) and stride == tuple(t.stride()) and not offset:
                return t._same()
        if any(isinstance(w, MXGatheredWeight) for w in _mutated_args(func, args, kwargs)):
            raise RuntimeError(f"{func}: an MXGatheredWeight is read-only (the master weight is the "
                               "sharded parameter)")
        plain = tree_map_only(MXGatheredWeight, lambda t: t.mx.dequantize(t.dtype), (args, kwargs))
        return func(*plain[0], **plain[1])


# --------------------------------------------------------------------------- model-level helpers
def _plain_weight_hook(module, state_dict, prefix, local_metadata) -> None:
    """state_dict post-hook: the master values instead of the wrapper (DTensor shards too)."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if value is None or isinstance(value, nn.Parameter):  # keep_vars=True wants the parameter
        return
    state_dict[key] = plain_master(value)


def plain_master(value: torch.Tensor) -> torch.Tensor:
    """``value`` with an MXShardedWeight replaced by its master tensor (inside a DTensor too)."""
    if isinstance(value, MXShardedWeight):
        return value.master
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return value
    if isinstance(value, DTensor) and isinstance(value._local_tensor, MXShardedWeight):
        return DTensor.from_local(value._local_tensor.master, value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    return value


def wrap_mx_weights(model: nn.Module) -> list[str]:
    """Wrap the plain weight of every :class:`MXLinear` in ``model`` in an MXShardedWeight (same
    values, same storage), in place; call before ``fully_shard`` and before building the
    optimizer. A tensor-parallel weight (a 2-D DTensor on a 1-D mesh) gets its local shard
    wrapped inside the DTensor; other DTensors and weights that are not 2-D stay as they are.
    Returns the names of the layers whose weights are wrapped (now or before)."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    done, new_params = [], {}
    for name, module in model.named_modules():
        if not isinstance(module, MXLinear):
            continue
        weight = module.weight
        if isinstance(weight, MXShardedWeight) or isinstance(getattr(weight, "_local_tensor", None), MXShardedWeight):
            done.append(name)
            continue
        tp_split = _is_tp_dtensor(weight)
        if not tp_split and (type(weight) is not nn.Parameter or weight.dim() != 2):
            continue
        if id(weight) not in new_params:  # tied weights stay tied
            c = module.mx_config
            if tp_split:    # a tensor-parallel shard: its local rows are what FSDP2 shards further
                from torch.distributed.tensor import DTensor

                local = MXShardedWeight(weight.to_local().detach(), c.elem, c.scale_rule, c.cast_backend)
                wrapped = DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False,
                                             shape=weight.shape, stride=weight.stride())
            else:
                wrapped = MXShardedWeight(weight.data, c.elem, c.scale_rule, c.cast_backend)
            new_params[id(weight)] = nn.Parameter(wrapped, requires_grad=weight.requires_grad)
        module.weight = new_params[id(weight)]
        if not getattr(module, "_mx_plain_state_dict", False):
            module._register_state_dict_hook(_plain_weight_hook)
            module._mx_plain_state_dict = True
        done.append(name)
    return done


def _is_tp_dtensor(weight) -> bool:
    """A 2-D DTensor parameter on a 1-D mesh (tensor parallelism), not yet wrapped."""
    return _is_dtensor(weight) and weight.dim() == 2 and weight.device_mesh.ndim == 1


def unwrap_mx_weights(model: nn.Module) -> list[str]:
    """Undo :func:`wrap_mx_weights` on an unsharded model (plain parameters, same storage)."""
    done = []
    for name, module in model.named_modules():
        if isinstance(module, MXLinear) and isinstance(module.weight, MXShardedWeight):
            module.weight = nn.Parameter(module.weight.master, requires_grad=module.weight.requires_grad)
            done.append(name)
    return done


def mx_gather_bytes(out_features: int, in_features: int, shards: int) -> int:
    """Bytes one rank sends per all-gather of an MX-gathered ``(out, in)`` weight (0 if it would
    fall back to a plain gather): elements plus scale bytes of its row shard."""
    if out_features % shards:
        return 0
    rows = out_features // shards
    return rows * in_features + rows * math.ceil(in_features / BLOCK)


__all__ = ["MXShardedWeight", "MXGatheredWeight", "wrap_mx_weights", "unwrap_mx_weights", "plain_master",
           "mx_gather_bytes"]
