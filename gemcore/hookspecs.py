"""The gemcore plugin contract (pluggy project name ``gemcore``).

Every hook is called with keyword arguments only; an implementation may accept a subset of them,
so a spec can gain an argument without breaking older plugins.

Hook points come in two shapes:

* **registries** (``gemcore_attention_impls``, ``gemcore_precision_policies``,
  ``gemcore_parallelism_impls``, ``gemcore_comms_backends``, ``gemcore_samplers``): every plugin
  may contribute a ``{name: factory}`` mapping; the plugin manager merges them (a name offered twice
  is an error naming both plugins) and the configuration picks one name per hook point.
* **lifecycle** (``gemcore_configure``, ``gemcore_after_step``, ``gemcore_end_run``): notifications.

A factory may carry an optional attribute ``unavailable() -> str | None`` saying why it cannot run
on this machine (a missing extra, no GPU); ``gem info`` reports it.

The factories' call signatures are part of the contract and are documented on each hook and in
``docs/architecture.md``.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import pluggy

PROJECT_NAME = "gemcore"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- attention
@hookspec
def gemcore_attention_impls() -> Mapping[str, Callable[..., Any]]:
    """Contribute named jagged attention implementations.

    :return: ``{name: factory}``. ``factory(config: gemcore.config.AttentionConfig)`` returns a
        callable ``attn(q, k, v, offsets, *, causal, num_targets, max_seqlen) -> out`` where
        ``q, k, v: (T, H, D)`` are jagged values, ``offsets: (B+1,)`` int64 sequence starts,
        ``num_targets: (B,)`` int64 or None (the last ``n`` tokens of each sequence are candidates
        that see the history and themselves only), ``max_seqlen: int`` and ``out: (T, H, D)``.
        All results are merged; ``attention.impl`` selects one.
    """


# --------------------------------------------------------------------------- precision
@hookspec
def gemcore_precision_policies() -> Mapping[str, Callable[..., Any]]:
    """Contribute named precision policies.

    :return: ``{name: factory}``. ``factory(config: gemcore.config.PrecisionConfig)`` returns a
        :class:`gemcore.precision.PrecisionPolicy`: ``compute_dtype``, ``comm_dtype``,
        ``apply(model, *, fsdp_size=1) -> model`` (convert modules in place) and
        ``autocast(device_type)`` (a context manager around the forward pass).
        ``precision.impl`` selects one. The trainer applies the policy before the parallelism
        and passes ``fsdp_size``, the ranks FSDP2 will shard each weight over (the parallelism's
        ``fsdp_size``; 1: not sharded), only to an ``apply`` that takes it; a policy reads no
        launcher environment to find it.
    """


# --------------------------------------------------------------------------- parallelism
@hookspec
def gemcore_parallelism_impls() -> Mapping[str, Callable[..., Any]]:
    """Contribute named parallelism planners/appliers.

    :return: ``{name: factory}``. ``factory(config: gemcore.config.ParallelismConfig, *, comm,
        run_config)`` returns a :class:`gemcore.parallel.Parallelism`: ``rank``, ``world_size``,
        ``describe() -> str``, ``apply(model, device) -> model`` and optionally ``fsdp_size``
        (ranks FSDP2 shards each weight over; ``world_size`` where absent). ``comm`` is the job's
        communicator (the ``communication`` hook's choice, ``comms.backend``) or None: a factory
        moves every byte of its collectives through it (``gemcore.comms.process_group`` makes it
        torch.distributed's default group). ``run_config`` is the whole
        :class:`gemcore.config.Config` of the run (device, model, attention), or None outside
        ``gem train``. ``parallelism.impl`` selects one.
    """


# --------------------------------------------------------------------------- communication
@hookspec
def gemcore_comms_backends() -> Mapping[str, Callable[..., Any]]:
    """Contribute named collective backends.

    :return: ``{name: factory}``. ``factory(**options)`` returns a communicator with ``rank``,
        ``world_size``, ``local_rank``, ``local_size``, ``backend`` and the collectives of
        :mod:`gemcore.comms`. ``comms.backend`` selects one (``"none"``: no communicator).
    """


# --------------------------------------------------------------------------- data
@hookspec
def gemcore_samplers() -> Mapping[str, Callable[..., Any]]:
    """Contribute named batch samplers.

    :return: ``{name: factory}``. ``factory(lengths, *, batch_size, world_size, rank, seed,
        drop_last)`` with ``lengths: (N,)`` int64 history lengths of the dataset returns an object
        that iterates over one epoch of lists of sample indices (one list per step for this rank;
        ``len()`` of them after ``set_epoch(e)``, the rest of the epoch after a mid-epoch
        ``load_state_dict(d)``) and has ``set_epoch(e)``, ``state_dict()`` and
        ``load_state_dict(d)``; the trainer calls ``set_epoch(e + 1)`` to start the next epoch. ``batch_size`` is the
        global batch in samples. ``data.sampler`` selects one. A factory may also take the optional
        keywords ``cost`` (callable: lengths (N,) int64 -> (N,) float64 per-sample training FLOPs,
        history plus candidates) and ``sub_batch`` (int); the trainer passes them only to factories
        whose signature accepts them.
    """


# --------------------------------------------------------------------------- lifecycle
@hookspec(historic=True)
def gemcore_configure(config: Any) -> None:
    """The validated :class:`gemcore.config.Config` of this run.

    Historic: a plugin registered later is still called with it.
    """


@hookspec
def gemcore_after_step(step: int, metrics: Mapping[str, float]) -> None:
    """Called after each optimizer step with that step's metrics row (``step``, ``loss``,
    ``tokens_per_s``, ...). Implementations must not modify ``metrics``."""


@hookspec
def gemcore_end_run(summary: Mapping[str, Any], run_dir: Any) -> None:
    """Called once at the end of ``gem train`` with the summary dict and the run folder (Path)."""
