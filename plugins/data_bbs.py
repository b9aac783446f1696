"""Built-in data sampler ``bbs``: Base Batch Shuffling, cost-balanced ranks with no communication."""
from gemcore.data.bbs import BaseBatchShuffler
from gemcore.hookspecs import hookimpl


def make_bbs(lengths, *, batch_size, world_size, rank, seed, drop_last, cost="attention", sub_batch=128):
    """The data hook's factory; ``batch_size`` is the global batch. ``cost`` is a name or a callable
    ``lengths -> per-sample cost`` (the trainer passes its model's FLOP counter)."""
    return BaseBatchShuffler(lengths, world_size=world_size, rank=rank, global_batch=batch_size,
                             sub_batch=sub_batch, seed=seed, cost=cost, drop_last=drop_last)


@hookimpl
def gemcore_samplers():
    return {"bbs": make_bbs}
