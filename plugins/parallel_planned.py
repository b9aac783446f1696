"""Built-in parallelism ``fsdp``, ``planned`` and ``auto`` (:mod:`gemcore.parallel.planned`)."""
from gemcore.hookspecs import hookimpl
from gemcore.parallel.planned import make_auto, make_fsdp, make_planned


@hookimpl
def gemcore_parallelism_impls():
    return {"fsdp": make_fsdp, "planned": make_planned, "auto": make_auto}
