"""Built-in parallelism ``single``: one process, no parallelism."""
from gemcore.hookspecs import hookimpl
from gemcore.parallel.base import Parallelism


@hookimpl
def gemcore_parallelism_impls():
    return {"single": lambda config, comm=None, run_config=None: Parallelism()}
