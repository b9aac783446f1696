"""Built-in data sampler ``random``."""
from gemcore.data.samplers import RandomBatchSampler
from gemcore.hookspecs import hookimpl


@hookimpl
def gemcore_samplers():
    return {"random": RandomBatchSampler}
