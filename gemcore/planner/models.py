"""Model descriptions the planner reasons about: shapes only, no weights.

A :class:`ModelSpec` holds what the cost model needs: layer count, widths, heads, vocabulary,
experts, and for GEM-style models the history-length law and the embedding tables. Presets carry
the published shapes of Llama 3 (Meta, "The Llama 3 Herd of Models", 2024, table 3) and
DeepSeek-V3 (DeepSeek-AI, 2024, the released ``config.json``); ``gem-small`` / ``gem-large`` are
GEM-style shapes of this project (no published GEM shapes exist). A TOML file with a ``[model]``
table gives the same fields (see :func:`load_model`).
"""
from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal

import numpy as np


#: tokens per optimizer step of an ``llm`` model's default global batch: the 4M tokens Llama 3 405B
#: started its pre-training with (Llama 3 paper, arXiv 2407.21783, section 3.4.1; it later doubled
#: to 8M and 16M)
DEFAULT_TOKENS_PER_STEP = 4 * 2**20


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of one model. Every width is in elements; every count is per model.

    ``ffn`` is the inner width of a SiLU-gated MLP (three matrices hidden x ffn); with experts,
    ``moe_ffn`` is each routed expert's inner width and ``first_dense_layers`` keep a dense MLP.
    ``kind = "gem"`` models read jagged histories: ``seq_len`` is the longest history, lengths
    follow ``length_law`` (gemcore.data.synthetic laws), each user adds ``num_candidates`` tokens,
    and ``embedding_rows`` x ``hidden`` item embeddings are sharded row-wise over all GPUs.
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    ffn: int
    vocab_size: int = 0
    head_dim: int = 0                 #: 0: hidden // num_heads
    kind: Literal["llm", "gem"] = "llm"
    seq_len: int = 8192               #: default sequence length (gem: longest history)
    batch_per_gpu: int = 1            #: default global batch = this x GPUs, capped (default_global_batch)
    # mixture of experts
    num_experts: int = 0              #: routed experts per MoE layer (0: dense)
    top_k: int = 0                    #: experts each token visits
    shared_experts: int = 0           #: always-on experts per MoE layer
    moe_ffn: int = 0                  #: inner width of each expert (0: ffn)
    first_dense_layers: int = 0       #: leading layers with a dense MLP of width ffn
    # multi-head latent attention (DeepSeek); kv_lora_rank = 0 means grouped-query attention
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    v_head_dim: int = 0
    # GEM-style inputs
    length_law: Literal["fixed", "heavytail", "dense95", "uniform"] = "fixed"
    num_candidates: int = 0
    embedding_rows: int = 0           #: rows of the sharded item-embedding table (gem)
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        positive = ("num_layers", "hidden", "num_heads", "num_kv_heads", "ffn", "seq_len", "batch_per_gpu")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads ({self.num_kv_heads}) must divide "
                             f"model.num_heads ({self.num_heads})")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"model.top_k ({self.top_k}) must be in [1, num_experts={self.num_experts}]")
        if self.kind not in ("llm", "gem"):
            raise ValueError(f"model.kind must be 'llm' or 'gem', got {self.kind!r}")
        if self.length_law not in ("fixed", "heavytail", "dense95", "uniform"):
            raise ValueError(f"model.length_law must be fixed, heavytail, dense95 or uniform, "
                             f"got {self.length_law!r}")
        if self.first_dense_layers > self.num_layers:
            raise ValueError(f"model.first_dense_layers ({self.first_dense_layers}) exceeds "
                             f"num_layers ({self.num_layers})")
        if self.kind == "llm" and self.vocab_size <= 0:
            raise ValueError("model.vocab_size must be positive for kind = 'llm'")

    # ------------------------------------------------------------------ shapes
    @property
    def qk_head_dim(self) -> int:
        if self.kv_lora_rank:
            return self.head_dim_base + self.rope_head_dim
        return self.head_dim_base

    @property
    def head_dim_base(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim or self.head_dim_base

    @property
    def kv_dim(self) -> int:
        """Width of K plus V per token as attention reads them (MLA: after up-projection)."""
        return self.num_kv_heads * (self.qk_head_dim + self.value_head_dim)

    def attention_params(self) -> int:
        """Weights of one attention block (projections only)."""
        h, H = self.hidden, self.num_heads
        if self.kv_lora_rank:
            nope = self.head_dim_base
            q = (h * self.q_lora_rank + self.q_lora_rank * H * (nope + self.rope_head_dim)
                 if self.q_lora_rank else h * H * (nope + self.rope_head_dim))
            kv = h * (self.kv_lora_rank + self.rope_head_dim) + self.kv_lora_rank * H * (nope + self.value_head_dim)
            return q + kv + H * self.value_head_dim * h
        q = h * H * self.qk_head_dim
        kv = h * self.num_kv_heads * (self.qk_head_dim + self.value_head_dim)
        return q + kv + H * self.value_head_dim * h

    def block_matmuls(self) -> tuple[tuple[str, int, int], ...]:
        """(name, in_features, out_features) of a dense grouped-query-attention block's matmuls in
        the order its forward calls them, as TorchTitan's Llama block does: wq, wk, wv, wo, then the
        MLP ``w2(silu(w1(x)) * w3(x))`` evaluates w1, w3, w2."""
        h, H, K, F = self.hidden, self.num_heads, self.num_kv_heads, self.ffn
        return (("wq", h, H * self.qk_head_dim), ("wk", h, K * self.qk_head_dim),
                ("wv", h, K * self.value_head_dim), ("wo", H * self.value_head_dim, h),
                ("w1", h, F), ("w3", h, F), ("w2", F, h))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.first_dense_layers if self.is_moe else 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn or self.ffn

    def expert_params_per_layer(self) -> int:
        """Routed experts' weights of one MoE layer (3 matrices each)."""
        return self.num_experts * 3 * self.hidden * self.expert_ffn

    def default_global_batch(self, gpus: int, seq_len: int | None = None) -> int:
        """Sequences (gem: users) per optimizer step when the user gives none: ``batch_per_gpu``
        per GPU, for ``llm`` models capped at :data:`DEFAULT_TOKENS_PER_STEP` tokens (at least one
        sequence), so a large cluster does not plan an unrealistically large batch."""
        batch = self.batch_per_gpu * gpus
        if self.kind == "llm":
            batch = min(batch, max(1, DEFAULT_TOKENS_PER_STEP // (seq_len or self.seq_len)))
        return batch

    def dense_params_per_layer(self, moe: bool) -> int:
        """Weights every token of a layer uses: attention, norms, dense MLP or shared experts + router."""
        norms = 2 * self.hidden
        if moe:
            mlp = self.shared_experts * 3 * self.hidden * self.expert_ffn + self.hidden * self.num_experts
        else:
            mlp = 3 * self.hidden * self.ffn
        return self.attention_params() + norms + mlp

    def embedding_params(self) -> int:
        """Input-embedding rows: the vocabulary (llm) or the item table (gem)."""
        rows = self.embedding_rows if self.kind == "gem" else self.vocab_size
        return rows * self.hidden

    def head_params(self) -> int:
        """Output layer: the LM head (untied) or the GEM click head (2h x h + h x 1)."""
        if self.kind == "gem":
            return 2 * self.hidden * self.hidden + self.hidden + self.hidden + 1
        return 0 if self.tied_embeddings else self.vocab_size * self.hidden

    @cached_property
    def layer_params(self) -> tuple[int, int]:
        """(dense, expert) weights summed over all layers."""
        dense = sum(self.dense_params_per_layer(self._is_moe_layer(i)) for i in range(self.num_layers))
        return dense, self.moe_layers * self.expert_params_per_layer()

    def _is_moe_layer(self, i: int) -> bool:
        return self.is_moe and i >= self.first_dense_layers

    def total_params(self) -> int:
        dense, expert = self.layer_params
        return dense + expert + self.embedding_params() + self.head_params() + self.hidden

    def active_matmul_params(self) -> int:
        """Weights a token multiplies with (routed experts: top_k of them; no input embedding)."""
        dense, _ = self.layer_params
        routed = self.moe_layers * self.top_k * 3 * self.hidden * self.expert_ffn
        return dense + routed + self.head_params()

    # ------------------------------------------------------------------ sequences
    def length_moments(self, seq_len: int) -> tuple[float, float]:
        """(E[L], E[L^2]) of one sequence's tokens at longest history ``seq_len``.

        ``fixed``: every sequence is ``seq_len`` long. The jagged laws are sampled once (200k
        draws, seed 0) from :func:`history_lengths`, plus candidates.
        """
        if self.length_law == "fixed":
            n = seq_len + self.num_candidates
            return float(n), float(n) ** 2
        return _length_moments(self.length_law, seq_len, self.num_candidates)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_MOMENTS: dict[tuple[str, int, int], tuple[float, float]] = {}


def _length_moments(law: str, seq_len: int, candidates: int) -> tuple[float, float]:
    key = (law, seq_len, candidates)
    if key not in _MOMENTS:
        import torch

        lengths = history_lengths(law, 200_000, seq_len, torch.Generator().manual_seed(0)).numpy().astype(np.float64)
        lengths += candidates
        _MOMENTS[key] = (float(lengths.mean()), float((lengths ** 2).mean()))
    return _MOMENTS[key]


def history_lengths(law: str, n: int, max_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(n,) history lengths of a jagged ``model.length_law``
    (:func:`gemcore.data.workloads.history_lengths`)."""
    from gemcore.data.workloads import history_lengths as draw

    try:
        return draw(law, n, max_len, generator)
    except ValueError:
        raise ValueError(f"model.length_law must be fixed, heavytail, dense95 or uniform, got {law!r}") from None


# ---------------------------------------------------------------------- presets
PRESETS: dict[str, ModelSpec] = {
    # Llama 3 table 3: layers, model dim, FFN dim, heads, KV heads, vocabulary 128,256.
    "llama3-8b": ModelSpec("llama3-8b", num_layers=32, hidden=4096, num_heads=32, num_kv_heads=8,
                           ffn=14336, vocab_size=128256),
    "llama3-70b": ModelSpec("llama3-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8,
                            ffn=28672, vocab_size=128256),
    "llama3-405b": ModelSpec("llama3-405b", num_layers=126, hidden=16384, num_heads=128, num_kv_heads=8,
                             ffn=53248, vocab_size=128256),
    # DeepSeek-V3 config.json: 61 layers (3 dense, intermediate 18432), 256 routed experts of
    # width 2048, top-8, 1 shared expert, MLA (q_lora 1536, kv_lora 512, nope 128, rope 64, v 128).
    "deepseek-v3": ModelSpec("deepseek-v3", num_layers=61, hidden=7168, num_heads=128, num_kv_heads=128,
                             ffn=18432, vocab_size=129280, head_dim=128, seq_len=4096,
                             num_experts=256, top_k=8, shared_experts=1, moe_ffn=2048,
                             first_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
                             rope_head_dim=64, v_head_dim=128),
    # GEM-style (this project's shapes): jagged heavy-tailed histories, item tables sharded
    # over all GPUs, attention blocks with SiLU-gated MLPs; gem-large adds experts.
    "gem-small": ModelSpec("gem-small", kind="gem", num_layers=8, hidden=512, num_heads=8, num_kv_heads=8,
                           ffn=2048, seq_len=2048, batch_per_gpu=256, length_law="heavytail",
                           num_candidates=8, embedding_rows=10_000_000),
    "gem-large": ModelSpec("gem-large", kind="gem", num_layers=24, hidden=2048, num_heads=16, num_kv_heads=16,
                           ffn=8192, seq_len=4096, batch_per_gpu=64, length_law="heavytail",
                           num_candidates=16, embedding_rows=200_000_000, num_experts=16, top_k=2,
                           moe_ffn=4096, first_dense_layers=4),
}

_FIELDS = {f.name: f for f in dataclasses.fields(ModelSpec)}


def model_from_dict(data: dict, where: str = "model") -> ModelSpec:
    """Build a spec from a mapping, naming any unknown or mistyped key."""
    kwargs = {}
    for key, value in data.items():
        if key not in _FIELDS:
            raise ValueError(f"{where}: unknown key {key!r}; known: {', '.join(_FIELDS)}")
        expected = _FIELDS[key].type
        if expected == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{where}.{key}: expected an integer, got {value!r}")
        if expected == "bool" and not isinstance(value, bool):
            raise ValueError(f"{where}.{key}: expected true/false, got {value!r}")
        kwargs[key] = value
    kwargs.setdefault("name", where)
    try:
        return ModelSpec(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{where}: {exc}") from None


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, or a TOML file whose ``[model]`` table (or top level) gives the fields.

    A file may start from a preset with ``base = "llama3-8b"`` and override fields.
    """
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".toml":
        raise ValueError(f"--model: {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) "
                         f"nor a .toml file")
    if not path.exists():
        raise ValueError(f"--model: no such file {name_or_path!r}")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--model {name_or_path}: invalid TOML: {exc}") from None
    table = dict(data.get("model", data))
    base = table.pop("base", None)
    if base is not None:
        if base not in PRESETS:
            raise ValueError(f"--model {name_or_path}: base {base!r} is not a preset ({', '.join(PRESETS)})")
        table = {**dataclasses.asdict(PRESETS[base]), **table}
    table.setdefault("name", path.stem)
    return model_from_dict(table, where=f"--model {path.name}")


def describe(spec: ModelSpec) -> str:
    dense, expert = spec.layer_params
    total = spec.total_params()
    active = spec.active_matmul_params()
    parts = [f"{spec.name}: {total / 1e9:.1f}B parameters", f"{active / 1e9:.1f}B active matmul"]
    if expert:
        parts.append(f"{spec.num_experts} experts top-{spec.top_k}")
    if spec.kind == "gem":
        mean, _ = spec.length_moments(spec.seq_len)
        parts.append(f"{spec.length_law} histories <= {spec.seq_len} (mean {mean:.0f} tokens)")
    return ", ".join(parts)


__all__ = ["DEFAULT_TOKENS_PER_STEP", "ModelSpec", "PRESETS", "load_model", "model_from_dict", "describe"]
