"""Typed run configuration: TOML files plus ``--set key=value`` overrides, validated on load.

Each section is a dataclass owned by the component it configures; every field carries a docstring
in its metadata (``doc``) and choices are ``Literal``. Hook-point choices are plain strings
validated against the plugin manager (they are open sets: plugins add names).
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration problem; the message is one line naming the key."""


def _f(default: Any, doc: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda d=default: list(d), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


@dataclass
class RunConfig:
    name: str = _f("", "run name; output goes to <out_dir>/<name> (default: a timestamp)")
    out_dir: str = _f("runs", "folder holding one sub-folder per run")
    seed: int = _f(0, "seed of the model initialisation, the data and the sampler")
    device: Literal["cpu", "cuda"] = _f("cpu", "where to train")
    max_steps: int = _f(300, "optimizer steps of the whole run (>= 1; the LR schedule spans them)")
    log_every: int = _f(10, "refresh the progress bar every N steps")
    eval_users: int = _f(1024, "held-out users scored for the AUC at the end")
    threads: int = _f(1, "torch CPU threads (0: torch's default, one per core; see docs/training.md, "
                         "CPU threads: one holds up beside other CPU-bound processes, more collapse)")
    deterministic: bool = _f(False, "bitwise-reproducible GPU runs: PyTorch's deterministic "
                                    "algorithms and cuBLAS's fixed workspace while training")
    flush_denormals: bool = _f(True, "CPU arithmetic treats subnormal floats as zero while training "
                                     "(their slow path cost a hidden-512 model 30% of its step)")


@dataclass
class ModelConfig:
    num_items: int = _f(2000, "item-id vocabulary size (embedding rows)")
    num_actions: int = _f(4, "distinct action types per history event")
    time_buckets: int = _f(32, "log-spaced buckets of the time-gap feature")
    hidden: int = _f(64, "model width")
    num_blocks: int = _f(2, "attention + MLP blocks")
    num_heads: int = _f(2, "attention heads; hidden must be divisible by it")
    mlp_ratio: int = _f(4, "MLP width as a multiple of hidden")
    moe_experts: int = _f(0, "experts of the mixture-of-experts MLP (0: dense MLP)")
    moe_top_k: int = _f(2, "experts each token is routed to")
    dropout: float = _f(0.0, "dropout probability after attention and MLP")


@dataclass
class DataConfig:
    source: Literal["synthetic", "jsonl", "parquet"] = _f("synthetic", "where samples come from")
    path: str = _f("", "file for the jsonl/parquet sources")
    kind: Literal["heavytail", "dense95", "uniform"] = _f("heavytail", "history-length law (gemcore.data.workloads)")
    num_users: int = _f(8192, "synthetic users (samples)")
    max_len: int = _f(256, "longest history, in events")
    num_candidates: int = _f(4, "candidate items scored per user")
    num_clusters: int = _f(16, "latent interest clusters of the synthetic Markov chains")
    heldout_fraction: float = _f(0.125, "share of users kept for the held-out AUC")
    batch_size: int = _f(64, "global batch, in users")
    sampler: str = _f("random", "data hook point: which batch sampler")
    sub_batch: int = _f(128, "bbs: most samples per balanced sub-batch of a rank's list")


@dataclass
class AttentionConfig:
    impl: str = _f("auto", "attention hook point: which implementation (auto: attention.activation, "
                           "Triton kernels on CUDA, the PyTorch reference on CPU)")
    activation: str = _f("softmax", "softmax | silu | gelu | gelu_tanh | relu | relu2 | identity")
    scale: float = _f(0.0, "q.k multiplier (0: 1/sqrt(head_dim))")
    norm: float = _f(0.0, "non-softmax output divisor (0: max_seqlen)")


@dataclass
class PrecisionConfig:
    impl: str = _f("fp32", "precision hook point: which policy")
    mx_elem: Literal["e4m3", "e5m2"] = _f("e4m3", "mxfp8: element format of activations and weights")
    mx_grad_elem: Literal["e4m3", "e5m2"] = _f("e4m3", "mxfp8: element format of gradients")
    mx_scale_rule: Literal["floor", "rceil"] = _f("rceil", "mxfp8: block scale rule (floor: OCP spec)")
    mx_min_features: int = _f(0, "mxfp8: keep linears with fewer in/out features in high precision")
    mx_keep: list[str] = _f(["router", "head"], "mxfp8: module-name parts kept in high precision")
    mx_fsdp_all_gather: bool = _f(True, "mxfp8: when FSDP2 shards the weights, all-gather the MX layers' weights in MX "
                                  "(1 + 1/32 bytes an element) and recast the dgrad weight from them")
    fp8_matmul: Literal["auto", "reference", "cublas", "scaled_mm", "triton"] = _f(
        "auto", "fp8_block: GEMM backend (auto: reference on CPU, on CUDA only a backend verified on that GPU)")
    fp8_keep: list[str] = _f(["router", "head"], "fp8_block: module-name parts kept in high precision")
    fp8_fused_mlp: bool = _f(False, "fp8_block: SwiGLU MLPs with the activation fused into its FP8 casts "
                             "(FP8BlockSwiGLU; activations between the layers in bf16)")
    fp8_fsdp_all_gather: bool = _f(True, "fp8_block: when FSDP2 shards the weights, all-gather the FP8 layers' weights "
                                   "in FP8 (1 byte an element plus a float32 scale per 128x128 block)")


@dataclass
class ParallelismConfig:
    impl: str = _f("single", "parallelism hook point: which planner/applier")
    degrees: str = _f("", "layout for impl='planned', e.g. 'dp_shard=2,tp=2' (gem plan --degrees syntax)")


@dataclass
class CommsConfig:
    backend: str = _f("none", "communication hook point: none | auto | single | torch | mpi | ce | a plugin's name")
    timeout_s: float = _f(300.0, "seconds a collective may wait for the other ranks")
    check: bool = _f(True, "exchange a signature per call so that mismatched calls raise")


@dataclass
class TrainConfig:
    lr: float = _f(3e-3, "peak learning rate (AdamW)")
    weight_decay: float = _f(0.01, "AdamW weight decay")
    warmup_steps: int = _f(20, "linear warm-up steps before the cosine decay")
    min_lr_ratio: float = _f(0.1, "final learning rate as a share of the peak")
    grad_clip: float = _f(1.0, "max global gradient norm (0: off)")
    checkpoint_every: int = _f(0, "save a checkpoint every N steps (0: only at the end)")
    max_time_s: float = _f(0.0, "stop after this many seconds (0: no limit)")
    eval_every: int = _f(0, "held-out AUC every N steps (0: only at the end)")
    gc_every: int = _f(50, "Python's automatic garbage collection off while training; generations "
                           "0-1 collected every N steps instead (0: automatic collection)")
    compile: bool = _f(False, "torch.compile each transformer block (dynamic shapes; the attention runs inside "
                              "its graph as an opaque op)")
    cuda_graphs: bool = _f(False, "replay each step's forward and backward as a CUDA graph, one per padded "
                                  "batch shape (one GPU, no parallelism; gemcore.cuda_graphs)")


@dataclass
class PluginsConfig:
    disable: list[str] = _f([], "plugin (entry-point) names not to load")


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    comms: CommsConfig = field(default_factory=CommsConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    plugins: PluginsConfig = field(default_factory=PluginsConfig)

    def __post_init__(self) -> None:
        m = self.model
        checks = [
            (m.hidden > 0 and m.hidden % max(m.num_heads, 1) == 0,
             f"model.hidden ({m.hidden}) must be a positive multiple of model.num_heads ({m.num_heads})"),
            (m.num_heads > 0, f"model.num_heads must be positive, got {m.num_heads}"),
            (m.num_blocks > 0, f"model.num_blocks must be positive, got {m.num_blocks}"),
            (m.num_items > 1, f"model.num_items must be > 1, got {m.num_items}"),
            (m.moe_experts == 0 or 0 < m.moe_top_k <= m.moe_experts,
             f"model.moe_top_k ({m.moe_top_k}) must be in [1, model.moe_experts={m.moe_experts}]"),
            (0.0 <= m.dropout < 1.0, f"model.dropout must be in [0, 1), got {m.dropout}"),
            (self.data.sub_batch > 0, f"data.sub_batch must be positive, got {self.data.sub_batch}"),
            (self.train.eval_every >= 0, f"train.eval_every must be >= 0, got {self.train.eval_every}"),
            (self.train.gc_every >= 0, f"train.gc_every must be >= 0, got {self.train.gc_every}"),
            (self.data.batch_size > 0, f"data.batch_size must be positive, got {self.data.batch_size}"),
            (self.data.max_len >= 1, f"data.max_len must be >= 1, got {self.data.max_len}"),
            (self.data.num_candidates >= 1, f"data.num_candidates must be >= 1, got {self.data.num_candidates}"),
            (0.0 < self.data.heldout_fraction < 1.0,
             f"data.heldout_fraction must be in (0, 1), got {self.data.heldout_fraction}"),
            (self.data.source == "synthetic" or self.data.path,
             f"data.path is required when data.source = {self.data.source!r}"),
            (self.run.max_steps >= 1, f"run.max_steps must be >= 1, got {self.run.max_steps}"),
            (self.run.threads >= 0, f"run.threads must be >= 0, got {self.run.threads}"),
            (self.train.lr > 0, f"train.lr must be positive, got {self.train.lr}"),
            (self.train.grad_clip >= 0, f"train.grad_clip must be >= 0, got {self.train.grad_clip}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    # ------------------------------------------------------------------ I/O
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        lines: list[str] = []
        for section, values in self.to_dict().items():
            lines.append(f"[{section}]")
            lines += [f"{key} = {_toml_value(value)}" for key, value in values.items()]
            lines.append("")
        return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------- loading
def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Build a :class:`Config` from an optional TOML file and ``key=value`` overrides.

    Raises :class:`ConfigError` (one line, naming the key) on unknown keys, wrong types or
    failed checks.
    """
    data: dict[str, Any] = {}
    if path is not None:
        try:
            data = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"--config: no such file {str(path)!r}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"--config {path}: invalid TOML: {exc}") from None
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set {item!r}: expected section.key=value")
        section, _, name = key.strip().partition(".")
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"{section}: expected a table")
        data[section][name] = _parse_override(raw.strip())
    return config_from_dict(data)


def _parse_override(raw: str) -> Any:
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw  # a bare word is a string: --set attention.impl=jfa


def config_from_dict(data: dict[str, Any]) -> Config:
    sections: dict[str, Any] = {}
    hints = typing.get_type_hints(Config)
    for section, values in data.items():
        if section not in hints:
            raise ConfigError(f"unknown config section {section!r}; known: {', '.join(hints)}")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a table, got {type(values).__name__}")
        cls = hints[section]
        field_hints = typing.get_type_hints(cls)
        kwargs = {}
        for key, value in values.items():
            if key not in field_hints:
                raise ConfigError(f"unknown config key {section}.{key}; known: {', '.join(field_hints)}")
            kwargs[key] = _check_type(f"{section}.{key}", value, field_hints[key])
        sections[section] = cls(**kwargs)
    return Config(**sections)


def _check_type(key: str, value: Any, expected: Any) -> Any:
    origin = typing.get_origin(expected)
    if origin is Literal:
        choices = typing.get_args(expected)
        if value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(repr, choices))}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(expected)
        if isinstance(value, str):  # --set plugins.disable=a,b
            value = [v for v in value.split(",") if v]
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        return [_check_type(key, v, item_type) for v in value]
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if expected in (int, float) and isinstance(value, bool) or not isinstance(value, expected):
        raise ConfigError(f"{key}: expected {expected.__name__}, got {type(value).__name__} {value!r}")
    return value
