"""``parallelism.impl = "auto"``: plan for the GPUs a run was launched on, among applicable plans."""
from __future__ import annotations

from gemcore.parallel.apply import check_supported
from gemcore.planner.cluster import GPUS, make_cluster
from gemcore.planner.models import ModelSpec
from gemcore.planner.plan import Plan
from gemcore.planner.search import search


def spec_from_config(config) -> ModelSpec:
    """The planner's view of a run's GemModel (gemcore.config.Config)."""
    m, d = config.model, config.data
    return ModelSpec(name="gem-run", kind="gem", num_layers=m.num_blocks, hidden=m.hidden,
                     num_heads=m.num_heads, num_kv_heads=m.num_heads, ffn=m.mlp_ratio * m.hidden,
                     seq_len=d.max_len, length_law=d.kind, num_candidates=d.num_candidates,
                     embedding_rows=m.num_items, num_experts=m.moe_experts,
                     top_k=m.moe_top_k if m.moe_experts else 0)


def local_gpu_kind() -> str:
    """The GPU table entry of this machine's CUDA device (h100 figures on CPU or an unknown GPU)."""
    import torch

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name().lower()
        for kind in GPUS:
            if kind in name:
                return kind
    return "h100"


def best_applicable_plan(config, world_size: int, local_world_size: int) -> Plan:
    """The best plan gemcore can apply; the model's data-parallel batch is ``data.batch_size``."""
    cluster = make_cluster(local_gpu_kind(), world_size, local_world_size)
    spec = spec_from_config(config)
    result = search(spec, cluster, seq_len=config.data.max_len, global_batch=config.data.batch_size,
                    top=1, allow=lambda p: not check_supported(p, num_blocks=config.model.num_blocks))
    if not result.plans:
        raise ValueError(f"parallelism.impl = 'auto': no applicable plan for {world_size} ranks "
                         f"({'; '.join(f'{k}: {v}' for k, v in result.rejected.items())})")
    return result.plans[0].plan
