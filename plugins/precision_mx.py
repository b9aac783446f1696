"""Built-in precision policy ``mxfp8``: :mod:`gemcore.precision.mx` (MX linear layers)."""
from gemcore.hookspecs import hookimpl
from gemcore.precision.mx import make_mx_policy


@hookimpl
def gemcore_precision_policies():
    return {"mxfp8": make_mx_policy}
