"""Built-in parallelism ``fsdp``, ``planned`` and ``auto``: torch.distributed from a planner Plan.

The process group comes from the launcher: torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``) or mpirun (``OMPI_COMM_WORLD_*``; ``MASTER_ADDR``/``MASTER_PORT`` default to
localhost:29500). Backend: nccl on CUDA, gloo otherwise.

* ``fsdp``: every rank in dp_shard (FSDP2 over the world).
* ``planned``: the degrees in ``parallelism.degrees`` (e.g. ``"dp_shard=2,tp=2"``), or the
  ``GEMCORE_PARALLEL_DEGREES`` environment variable while the config section lacks that key.
* ``auto``: the planner's best plan among those gemcore can apply (``check_supported``: pp ×
  virtual stages dividing the blocks) for the model of this run (``gemcore_configure`` hands it over) on the GPUs
  launched.

With pp > 1, ``apply`` returns a :class:`~gemcore.planner.pipeline_parallel.PipelinedGemModel`
(this rank's stages): the trainer and the smoke run call its ``forward_backward(batch)`` instead
of ``forward`` + ``backward``, and :meth:`PlannedParallelism.clip_grad_norm_` sums the gradient norm
over the stages.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from gemcore.hookspecs import hookimpl
from gemcore.parallel import Parallelism
from gemcore.planner.plan import Plan

_RUN_CONFIG = {}


def launcher_env() -> dict[str, int]:
    """rank, world_size, local_rank, local_world_size from torchrun or mpirun (1 process if neither)."""
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:
        world, rank = int(env["WORLD_SIZE"]), int(env["RANK"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    elif "OMPI_COMM_WORLD_SIZE" in env:
        world, rank = int(env["OMPI_COMM_WORLD_SIZE"]), int(env["OMPI_COMM_WORLD_RANK"])
        local_rank = int(env.get("OMPI_COMM_WORLD_LOCAL_RANK", rank))
        local_world = int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", world))
    else:
        world, rank, local_rank, local_world = 1, 0, 0, 1
    return {"rank": rank, "world_size": world, "local_rank": local_rank, "local_world_size": local_world}


def run_device() -> str:
    """The device the run trains on: its config's ``run.device``; without a run config (the
    planner's own tools), CUDA where there is a GPU."""
    run_config = _RUN_CONFIG.get("config")
    if run_config is not None:
        return run_config.run.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_process_group(env: dict[str, int], device: str) -> bool:
    """Join the launcher's default process group (NCCL for ``device`` "cuda", else gloo); False
    when one already exists (not ours). On CUDA each local rank takes the GPU of its index, so
    more local ranks than visible GPUs is a ValueError naming both counts."""
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29500")
    backend = "nccl" if device == "cuda" else "gloo"
    if backend == "nccl":
        visible = torch.cuda.device_count()
        if env["local_rank"] >= visible:
            raise ValueError(
                f"run.device = 'cuda': {env['local_world_size']} processes were launched on this "
                f"node but {visible} CUDA device(s) are visible (local rank {env['local_rank']} has "
                f"none); launch at most {visible} per node, or train with run.device = 'cpu' (gloo)")
        torch.cuda.set_device(env["local_rank"])
    dist.init_process_group(backend, rank=env["rank"], world_size=env["world_size"])
    return True


class PlannedParallelism(Parallelism):
    """Applies ``plan`` with :func:`gemcore.planner.apply.apply_plan`; ``rank``/``world_size`` are
    this process's data-parallel coordinates (tp ranks of one group read the same samples).
    ``device`` ("cpu" or "cuda") picks the process group's backend and the mesh's device; by
    default the run's ``run.device`` (:func:`run_device`)."""

    name = "planned"

    def __init__(self, plan: Plan, env: dict[str, int], device: str | None = None):
        from gemcore.planner.apply import check_supported

        missing = check_supported(plan)
        if missing:
            raise ValueError("parallelism.degrees: cannot apply " + "; ".join(missing))
        if plan.num_gpus != env["world_size"]:
            raise ValueError(f"parallelism.degrees: {plan.factors()} = {plan.num_gpus}, but "
                             f"{env['world_size']} processes were launched")
        self.plan, self.env = plan, env
        self.mesh = None
        self.rank, self.world_size = 0, 1
        self._owns_group = False
        if env["world_size"] > 1:
            from gemcore.planner.apply import build_mesh, data_parallel_coordinates

            device = device or run_device()
            self._owns_group = init_process_group(env, device)
            self.mesh = build_mesh(plan, device)
            self.rank, self.world_size = data_parallel_coordinates(self.mesh)

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        if self.mesh is None:
            return model.to(device)
        from gemcore.planner.apply import apply_plan

        return apply_plan(model, self.plan, device, self.mesh, attention=_attention_spec())

    def close(self) -> None:
        """Tear down the process group this object made, once every rank is past its last
        collective (a rank destroying its gloo groups while a peer still had one in flight
        aborted that peer)."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False

    def describe(self) -> str:
        degrees = ", ".join(f"{k}={v}" for k, v in self.plan.degrees().items() if v > 1) or "1 process"
        pipeline = ""
        if self.plan.pp > 1:
            pipeline = f", schedule={self.plan.schedule}, v={self.plan.virtual_stages}, mbs={self.plan.mbs}"
        return f"planned: {degrees}, ac={self.plan.ac}{pipeline} ({self.env['world_size']} ranks)"

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Gradient clipping that works when TP and FSDP leave DTensors on several meshes, and
        across pipeline stages (each holds its own parameters)."""
        from gemcore.planner.apply import clip_grad_norm_

        pp_group = None
        if self.mesh is not None and self.plan.pp > 1:
            from gemcore.planner.plan import MeshAxis

            pp_group = self.mesh[MeshAxis.PP.value].get_group()
        return clip_grad_norm_(parameters, max_norm, pp_group=pp_group)

    def all_reduce_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.mesh is None:
            return value
        import torch.distributed as dist

        out = value.detach().clone()
        dist.all_reduce(out)
        return out / self.env["world_size"]


def _attention_spec() -> dict:
    """The run's attention config as context parallelism needs it (defaults without a run config)."""
    attention = getattr(_RUN_CONFIG.get("config"), "attention", None)
    if attention is None:
        return {}
    activation = attention.activation
    return {"activation": activation, "scale": attention.scale or None,
            "norm": (attention.norm or None) if activation != "softmax" else None}


def _degrees_from(config) -> str:
    return getattr(config, "degrees", "") or os.environ.get("GEMCORE_PARALLEL_DEGREES", "")


def make_fsdp(config, comm=None) -> PlannedParallelism:
    env = launcher_env()
    return PlannedParallelism(Plan(dp_shard=env["world_size"]), env)


def make_planned(config, comm=None) -> PlannedParallelism:
    env = launcher_env()
    text = _degrees_from(config)
    if not text:
        raise ValueError("parallelism.impl = 'planned' needs parallelism.degrees (or "
                         "GEMCORE_PARALLEL_DEGREES), e.g. 'dp_shard=2,tp=2'")
    return PlannedParallelism(Plan.parse(text), env)


def make_auto(config, comm=None) -> PlannedParallelism:
    env = launcher_env()
    run_config = _RUN_CONFIG.get("config")
    if run_config is None or env["world_size"] == 1:
        return PlannedParallelism(Plan(dp_shard=env["world_size"]), env)
    from gemcore.planner.auto import best_applicable_plan

    plan = best_applicable_plan(run_config, env["world_size"], env["local_world_size"])
    return PlannedParallelism(plan, env)


@hookimpl
def gemcore_configure(config):
    _RUN_CONFIG["config"] = config


@hookimpl
def gemcore_parallelism_impls():
    return {"fsdp": make_fsdp, "planned": make_planned, "auto": make_auto}
