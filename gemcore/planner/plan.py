"""A parallel plan as data: degrees of each mesh axis plus the step's schedule knobs.

Rank order (outermost first) is :data:`MESH_ORDER`: ``pp, dp_replicate, dp_shard, cp, tp`` — tp
varies fastest, so tp (then cp) groups are consecutive ranks and land inside a node first.
Expert parallelism borrows ranks from ``dp_shard x cp`` (the innermost ``ep`` of them, stride tp):
experts are split over ``ep`` ranks and FSDP-sharded over the remaining ``dp_shard*cp/ep``. So the
GPU count is ``pp * dp_replicate * dp_shard * cp * tp`` and ``ep`` must divide ``dp_shard * cp``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import Literal


class MeshAxis(str, Enum):
    """Names of the DeviceMesh dimensions (one place; apply.py and the cost model use these)."""

    PP = "pp"
    DP_REPLICATE = "dp_replicate"
    DP_SHARD = "dp_shard"
    CP = "cp"
    TP = "tp"
    EP = "ep"  #: not a mesh dimension of its own: a sub-group of dp_shard x cp


#: DeviceMesh dimensions, outermost (slowest varying rank) first
MESH_ORDER: tuple[MeshAxis, ...] = (MeshAxis.PP, MeshAxis.DP_REPLICATE, MeshAxis.DP_SHARD, MeshAxis.CP,
                                     MeshAxis.TP)

AC_MODES = ("none", "selective", "full")
#: which matmul outputs ``ac=selective`` keeps: ``all_mm`` every one (gemcore's ``apply_ac``);
#: ``every_other_mm`` TorchTitan's selective *op* policy, which counts a block's ``aten.mm`` calls in
#: forward order and recomputes the even-numbered ones (the cost model's block: wq, wk, wv, wo, w1,
#: w3, w2, so wk, wo and w3 are recomputed)
SAC_POLICIES = ("all_mm", "every_other_mm")
SCHEDULES = ("1F1B", "interleaved")


#: short ``--degrees`` keys -> Plan field names
PARSE_ALIASES = {"v": "virtual_stages", "vpp": "virtual_stages", "reshard": "reshard_after_forward"}


class PlanError(ValueError):
    """A plan that breaks a rule; the message names the rule and prints every factor."""


@dataclass(frozen=True)
class Plan:
    """Degrees and schedule of one layout. Validated at construction (positive degrees, ep within
    dp_shard x cp, and ``world_size`` when given); :meth:`violations` checks it against a model."""

    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    mbs: int = 1                     #: micro-batch, in sequences (users for GEM models)
    ac: Literal["none", "selective", "full"] = "none"
    sac: Literal["all_mm", "every_other_mm"] = "all_mm"  #: ``ac=selective``'s policy (SAC_POLICIES)
    schedule: Literal["1F1B", "interleaved"] = "1F1B"
    virtual_stages: int = 1          #: model chunks per pipeline rank (interleaved schedule)
    #: FSDP: free gathered weights after each forward. Default (None): on without a pipeline, off
    #: with one (pp > 1), as TorchTitan's default policy: a pipeline's every micro-batch would gather
    #: the stage's weights again (deepseek-v3, pp=16 x tp=8 x dp_shard=2 on 256 H200: 69 s of
    #: exposed gathers per step resharded, 0.4 s not)
    reshard_after_forward: bool | None = None
    world_size: int | None = None    #: if given, the degrees' product must equal it

    def __post_init__(self) -> None:
        if self.reshard_after_forward is None:
            object.__setattr__(self, "reshard_after_forward", self.pp == 1)
        for name in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep", "mbs", "virtual_stages"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{name} must be a positive integer, got {value!r}")
        if self.ac not in AC_MODES:
            raise PlanError(f"ac must be one of {', '.join(AC_MODES)}, got {self.ac!r}")
        if self.sac not in SAC_POLICIES:
            raise PlanError(f"sac must be one of {', '.join(SAC_POLICIES)}, got {self.sac!r}")
        if self.sac != "all_mm" and self.ac != "selective":
            raise PlanError(f"sac={self.sac} is a policy of ac=selective, but ac={self.ac}")
        if self.schedule not in SCHEDULES:
            raise PlanError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "1F1B" and self.virtual_stages != 1:
            raise PlanError(f"virtual_stages={self.virtual_stages} needs schedule='interleaved'")
        if (self.dp_shard * self.cp) % self.ep:
            raise PlanError(f"ep={self.ep} must divide dp_shard × cp = {self.dp_shard} × {self.cp} = "
                            f"{self.dp_shard * self.cp} (experts borrow data-parallel ranks)")
        if self.world_size is not None and self.num_gpus != self.world_size:
            raise PlanError(f"{self.factors()} = {self.num_gpus}, but the world size is {self.world_size}")

    # ------------------------------------------------------------------ derived
    @property
    def num_gpus(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks (each reads its own sequences)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_size(self) -> int:
        """Ranks a dense weight is sharded over (FSDP over dp_shard x cp, as TorchTitan does)."""
        return self.dp_shard * self.cp

    def degree(self, axis: MeshAxis) -> int:
        return getattr(self, axis.value)

    def stride(self, axis: MeshAxis) -> int:
        """Rank distance between neighbours of ``axis`` (product of the faster axes)."""
        return self._strides[axis]

    @cached_property
    def _strides(self) -> dict[MeshAxis, int]:
        strides = {MeshAxis.EP: self.tp}
        for i, axis in enumerate(MESH_ORDER):
            strides[axis] = math.prod(self.degree(a) for a in MESH_ORDER[i + 1:])
        return strides

    def factors(self) -> str:
        return " × ".join(f"{a.value}={self.degree(a)}" for a in MESH_ORDER) + f" (ep={self.ep})"

    def degrees(self) -> dict[str, int]:
        return {a.value: self.degree(a) for a in (*MESH_ORDER, MeshAxis.EP)}

    def num_microbatches(self, global_batch: int) -> int:
        return global_batch // (self.dp * self.mbs)

    # ------------------------------------------------------------------ rules
    def violations(self, model, global_batch: int, world_size: int) -> list[str]:
        """Every rule this plan breaks for ``model`` (a ModelSpec) on ``world_size`` GPUs."""
        return [message for _, message in self.broken_rules(model, global_batch, world_size)]

    def broken_rules(self, model, global_batch: int, world_size: int) -> list[tuple[str, str]]:
        """(rule, message) for each broken rule; ``rule`` is a short stable name for counting."""
        out = []
        if self.num_gpus != world_size:
            out.append(("gpu count", f"{self.factors()} = {self.num_gpus} GPUs, but the cluster has {world_size}"))
        if model.num_heads % self.tp or model.num_kv_heads % self.tp:
            out.append(("tp vs heads", f"tp={self.tp} must divide the heads ({model.num_heads}) and kv heads "
                                       f"({model.num_kv_heads})"))
        if self.ep > 1 and not model.is_moe:
            out.append(("ep vs experts", f"ep={self.ep} needs a mixture-of-experts model; {model.name} is dense"))
        elif model.is_moe and model.num_experts % self.ep:
            out.append(("ep vs experts", f"ep={self.ep} must divide the experts ({model.num_experts})"))
        stages = self.pp * self.virtual_stages
        if stages > model.num_layers:
            out.append(("pp vs layers", f"pp × virtual_stages = {self.pp} × {self.virtual_stages} = {stages} "
                                        f"exceeds the layers ({model.num_layers})"))
        per_rank, rest = divmod(global_batch, self.dp * self.mbs)
        if rest or per_rank == 0:
            out.append(("batch split", f"global batch {global_batch} must be a positive multiple of dp_replicate "
                                       f"× dp_shard × mbs = {self.dp_replicate} × {self.dp_shard} × {self.mbs} "
                                       f"= {self.dp * self.mbs}"))
        elif self.pp > 1 and per_rank < self.pp:
            out.append(("pipeline micro-batches",
                        f"pp={self.pp} needs at least {self.pp} micro-batches per step, the batch gives "
                        f"{per_rank} (global batch {global_batch} / (dp {self.dp} × mbs {self.mbs}))"))
        if self.sac == "every_other_mm" and (model.kind != "llm" or model.is_moe or model.kv_lora_rank):
            what = ("has experts" if model.is_moe else "uses latent attention" if model.kv_lora_rank
                    else f"is a {model.kind} model")
            out.append(("sac policy", f"sac=every_other_mm is modelled for dense grouped-query-attention LLMs "
                                      f"only (TorchTitan's Llama block); {model.name} {what}"))
        if self.pp == 1 and self.schedule != "1F1B":
            out.append(("schedule", "an interleaved schedule needs pp > 1"))
        return out

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("world_size")
        return d

    @classmethod
    def parse_given(cls, text: str, world_size: int | None = None) -> tuple["Plan", set[str]]:
        """:meth:`parse`, plus the field names ``text`` sets (``v`` counts as ``virtual_stages``
        and ``schedule``)."""
        plan = cls.parse(text, world_size)
        given = set()
        for item in filter(None, (part.strip() for part in text.split(","))):
            key = item.partition("=")[0].strip()
            given.add(PARSE_ALIASES.get(key, key))
        if "virtual_stages" in given:
            given.add("schedule")
        return plan, given

    @classmethod
    def parse(cls, text: str, world_size: int | None = None) -> "Plan":
        """``dp_shard=32,tp=8[,dp_replicate=..,cp=..,ep=..,pp=..,mbs=..,ac=..,sac=..,schedule=..,v=..]``."""
        kwargs: dict = {}
        aliases = PARSE_ALIASES
        known = {f.name for f in dataclasses.fields(cls)} - {"world_size"}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, raw = item.partition("=")
            key = aliases.get(key.strip(), key.strip())
            if not sep or key not in known:
                raise ValueError(f"--degrees: {item!r} is not KEY=VALUE with KEY in "
                                 f"{', '.join(sorted(known | set(aliases)))}")
            raw = raw.strip()
            if key in ("ac", "sac", "schedule"):
                kwargs[key] = raw
            elif key == "reshard_after_forward":
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(f"--degrees: {key} must be true or false, got {raw!r}")
                kwargs[key] = raw.lower() in ("true", "1")
            else:
                try:
                    kwargs[key] = int(raw)
                except ValueError:
                    raise ValueError(f"--degrees: {key} must be an integer, got {raw!r}") from None
        if kwargs.get("virtual_stages", 1) > 1:
            kwargs.setdefault("schedule", "interleaved")
        try:
            return cls(**kwargs, world_size=world_size)
        except PlanError as exc:
            raise PlanError(f"--degrees: {exc}") from None


__all__ = ["MeshAxis", "MESH_ORDER", "Plan", "PlanError", "AC_MODES", "SAC_POLICIES", "SCHEDULES"]
