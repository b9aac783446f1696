"""Parallelism from a planner :class:`~gemcore.planner.plan.Plan`, on the job's communicator.

The process group comes from the launcher (torchrun, Open MPI, MPICH: :func:`gemcore.comms.launch.detect`).
Which library moves the bytes is the communication hook's choice, ``comms.backend``:

* ``none`` or ``torch``: torch.distributed's own backends, NCCL on CUDA and gloo on CPU;
* ``mpi``, ``ce`` or a plugin's backend: torch.distributed's default group is a gemcore process
  group over that communicator (:mod:`gemcore.comms.process_group`), so every mesh dimension, and
  FSDP2, DTensor TP, context parallelism, pipelining and expert all-to-alls with it, runs there.

:meth:`PlannedParallelism.carriers` says which backend carries each mesh dimension.
With pp > 1, ``apply`` returns a :class:`~gemcore.parallel.pipeline.PipelinedGemModel` (this rank's
stages): the trainer calls its ``forward_backward(batch)`` instead of ``forward`` + ``backward``, and
:meth:`PlannedParallelism.clip_grad_norm_` sums the gradient norm over the stages.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from gemcore.comms.base import Communicator
from gemcore.parallel.base import Parallelism
from gemcore.planner.plan import Plan


def launch_env() -> dict[str, int]:
    """rank, world_size, local_rank, local_world_size of this process (1 process if no launcher;
    one node assumed when the launcher gives no local rank): :func:`gemcore.comms.launch.detect_placement`."""
    from gemcore.comms.launch import detect_placement

    info = detect_placement()
    return {"rank": info.rank, "world_size": info.world_size, "local_rank": info.local_rank,
            "local_world_size": info.local_size}


def native_backend(comm: Communicator | None) -> bool:
    """Whether ``comm`` leaves the process group to torch.distributed's own backends."""
    return comm is None or comm.backend in ("torch", "single")


def init_process_group(env: dict[str, int], device: str, comm: Communicator | None = None) -> bool:
    """Join the job's default process group; False when one already exists (not ours).

    :param comm: the job's communicator: None or ``torch``: NCCL for ``device`` "cuda", else gloo
        (on CUDA each local rank takes the GPU of its index, so more local ranks than visible GPUs
        is a ValueError naming both counts); another backend: a gemcore process group over it.
    """
    import torch.distributed as dist

    if not native_backend(comm):
        from gemcore.comms import process_group

        served = process_group.SERVED_DEVICES.get(comm.backend, ("cpu", "cuda"))
        if device not in served:
            raise ValueError(f"comms.backend = {comm.backend!r} serves {', '.join(served)} tensors, but "
                             f"run.device = {device!r}")
        if device == "cuda":
            torch.cuda.set_device(env["local_rank"] % torch.cuda.device_count())
        if dist.is_initialized():
            return False
        process_group.init_process_group(comm)
        return True
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
                f"none); NCCL needs a GPU per process: launch at most {visible} per node, or share "
                f"one GPU with comms.backend = 'ce'")
        torch.cuda.set_device(env["local_rank"])
    dist.init_process_group(backend, rank=env["rank"], world_size=env["world_size"])
    return True


class PlannedParallelism(Parallelism):
    """Applies ``plan`` with :func:`gemcore.parallel.apply.apply_plan`; ``rank``/``world_size`` are
    this process's data-parallel coordinates (tp ranks of one group read the same samples).

    :param device: "cpu" or "cuda": the mesh's device (and NCCL vs gloo for the native backends).
    :param comm: the job's communicator (the ``communication`` hook's choice) or None.
    :param attention: the run's attention settings as context parallelism needs them.
    :param label: the name :meth:`describe` starts with (``fsdp``, ``planned``, ``auto``).
    """

    name = "planned"

    def __init__(self, plan: Plan, env: dict[str, int], device: str = "cpu", *,
                 comm: Communicator | None = None, attention: dict | None = None,
                 label: str = "planned") -> None:
        from gemcore.parallel.apply import check_supported

        missing = check_supported(plan)
        if missing:
            raise ValueError("parallelism.degrees: cannot apply " + "; ".join(missing))
        if plan.num_gpus != env["world_size"]:
            raise ValueError(f"parallelism.degrees: {plan.factors()} = {plan.num_gpus}, but "
                             f"{env['world_size']} processes were launched")
        self.plan, self.env, self.comm = plan, env, comm
        self.attention = attention or {}
        self.label = label
        self.mesh = None
        self.rank, self.world_size, self.fsdp_size = 0, 1, 1
        self._owns_group = False
        if env["world_size"] > 1:
            from gemcore.parallel.apply import build_mesh, data_parallel_coordinates

            self._owns_group = init_process_group(env, device, comm)
            self.mesh = build_mesh(plan, device)
            self.rank, self.world_size = data_parallel_coordinates(self.mesh)
            self.fsdp_size = plan.fsdp_size  # FSDP2 over dp_shard x cp (HSDP: per replica)

    def apply(self, model: nn.Module, device: torch.device) -> nn.Module:
        if self.mesh is None:
            return model.to(device)
        from gemcore.parallel.apply import apply_plan

        return apply_plan(model, self.plan, device, self.mesh, attention=self.attention)

    def close(self) -> None:
        """Tear down the process group this object made, once every rank is past its last
        collective (a rank destroying its gloo groups while a peer still had one in flight
        aborted that peer)."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            from gemcore.comms.rendezvous import forget_store

            forget_store()
        self._owns_group = False

    def carriers(self) -> dict[str, str]:
        """``{mesh dimension of size > 1: torch.distributed backend carrying it}``."""
        if self.mesh is None:
            return {}
        from gemcore.comms.process_group import carriers

        sizes = dict(zip(self.mesh.mesh_dim_names, self.mesh.mesh.shape))
        return {dim: name for dim, name in carriers(self.mesh).items() if sizes[dim] > 1}

    def describe(self) -> str:
        degrees = ", ".join(f"{k}={v}" for k, v in self.plan.degrees().items() if v > 1) or "1 process"
        pipeline = ""
        if self.plan.pp > 1:
            pipeline = f", schedule={self.plan.schedule}, v={self.plan.virtual_stages}, mbs={self.plan.mbs}"
        carried = ", ".join(sorted(set(self.carriers().values())))
        over = f" over {carried}" if carried else ""
        ac = f", ac={self.plan.ac}" if self.label != "fsdp" or self.plan.ac != "none" else ""
        return f"{self.label}: {degrees}{ac}{pipeline} ({self.env['world_size']} ranks{over})"

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        """Gradient clipping that works when TP and FSDP leave DTensors on several meshes, and
        across pipeline stages (each holds its own parameters)."""
        from gemcore.parallel.apply import clip_grad_norm_

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


def attention_spec(run_config) -> dict:
    """The run's attention config as context parallelism needs it (defaults without a run config)."""
    attention = getattr(run_config, "attention", None)
    if attention is None:
        return {}
    activation = attention.activation
    return {"activation": activation, "scale": attention.scale or None,
            "norm": (attention.norm or None) if activation != "softmax" else None}


def _device(run_config) -> str:
    if run_config is not None:
        return run_config.run.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_fsdp(config, comm: Communicator | None = None, run_config=None) -> PlannedParallelism:
    """FSDP2 over every rank (``parallelism.impl = "fsdp"``)."""
    env = launch_env()
    return PlannedParallelism(Plan(dp_shard=env["world_size"]), env, _device(run_config), comm=comm,
                              attention=attention_spec(run_config), label="fsdp")


def make_planned(config, comm: Communicator | None = None, run_config=None) -> PlannedParallelism:
    """The degrees of ``parallelism.degrees`` (e.g. ``"dp_shard=2,tp=2"``)."""
    env = launch_env()
    text = getattr(config, "degrees", "")
    if not text:
        raise ValueError("parallelism.impl = 'planned' needs parallelism.degrees, e.g. 'dp_shard=2,tp=2'")
    return PlannedParallelism(Plan.parse(text), env, _device(run_config), comm=comm,
                              attention=attention_spec(run_config))


def make_auto(config, comm: Communicator | None = None, run_config=None) -> PlannedParallelism:
    """The planner's best plan among those gemcore can apply, for this run's model and ranks."""
    env = launch_env()
    device = _device(run_config)
    if run_config is None or env["world_size"] == 1:
        return PlannedParallelism(Plan(dp_shard=env["world_size"]), env, device, comm=comm,
                                  attention=attention_spec(run_config), label="auto")
    from gemcore.parallel.auto import best_applicable_plan

    plan = best_applicable_plan(run_config, env["world_size"], env["local_world_size"])
    return PlannedParallelism(plan, env, device, comm=comm, attention=attention_spec(run_config),
                              label="auto")
