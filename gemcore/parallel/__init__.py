"""Applying parallelism: the :class:`Parallelism` interface and the FSDP2, TP, EP, CP and PP
appliers (``apply``, ``expert``, ``context``, ``pipeline``), distributed state dicts
(``state_dict``) and the planned/auto/fsdp layouts (``planned``, ``auto``). Deciding which layout
to use is :mod:`gemcore.planner`'s job."""
from gemcore.parallel.base import Parallelism

__all__ = ["Parallelism"]
