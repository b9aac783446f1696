"""gemcore.gc_schedule: automatic garbage collection off while training, collections on a schedule."""
import gc

import pytest
import torch

from gemcore.gc_schedule import ScheduledGC


@pytest.fixture
def collections():
    """Generation numbers of the collections that run while the test does."""
    seen = []

    def record(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(record)
    yield seen
    gc.callbacks.remove(record)


def test_collector_off_inside_with_scheduled_young_collections(collections):
    assert gc.isenabled()
    with ScheduledGC(every=3) as schedule:
        assert not gc.isenabled()
        collections.clear()                      # the one on entry
        for step in range(1, 8):
            schedule.step(step)
            [[] for _ in range(50_000)]          # allocations that would trigger gen-0 passes
            if step in (3, 6):
                assert collections == [1] * (step // 3), step
        assert schedule.collections == 2 and collections == [1, 1]
        with ScheduledGC(every=5):              # nested: the outer block keeps it off
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_every_zero_changes_nothing():
    with ScheduledGC(every=0) as schedule:
        assert gc.isenabled()
        for step in range(1, 4):
            schedule.step(step)
    assert schedule.collections == 0 and gc.isenabled()
    gc.disable()
    try:
        with ScheduledGC(every=2) as schedule:   # a collector off before stays off after
            assert not gc.isenabled()
            schedule.step(2)
            assert schedule.collections == 1
        assert not gc.isenabled()
    finally:
        gc.enable()


@pytest.mark.parametrize("every", [-1, 2.5, True, "50"])
def test_bad_every_is_refused(every):
    with pytest.raises(ValueError, match="every must be an int >= 0"):
        ScheduledGC(every)


def test_train_gc_every_is_validated():
    from gemcore.config import load_config

    with pytest.raises(ValueError, match="train.gc_every must be >= 0"):
        load_config(None, ["train.gc_every=-1"])


@pytest.mark.parametrize("every", [2, 0])
def test_training_steps_run_with_the_configured_schedule(tmp_path, every):
    """train.gc_every (default 50): the steps run with automatic collection off and a young
    collection after every ``every``-th step; 0 leaves Python's collector on. Back on afterwards."""
    from conftest import TINY as TINY_OVERRIDES

    from gemcore.config import load_config
    from gemcore.hookspecs import hookimpl
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    enabled = []

    class Recorder:
        @hookimpl
        def gemcore_after_step(self, step, metrics):
            enabled.append(gc.isenabled())

    config = load_config(None, [*TINY_OVERRIDES, f"run.out_dir='{tmp_path}'", "run.name='g'",
                                "run.max_steps=3", f"train.gc_every={every}"])
    manager = create_plugin_manager()
    manager.register(Recorder(), name="recorder")
    run_training(config, manager)
    assert enabled == [every == 0] * 3
    assert gc.isenabled()
    assert torch.is_grad_enabled()


def test_a_resumed_run_may_change_the_schedule(tmp_path):
    """train.gc_every changes no arithmetic, so --resume accepts a different value."""
    from conftest import TINY as TINY_OVERRIDES

    from gemcore.config import load_config
    from gemcore.plugin_manager import create_plugin_manager
    from gemcore.trainer import run_training

    common = [*TINY_OVERRIDES, f"run.out_dir='{tmp_path}'", "run.name='r'"]
    _, run_dir = run_training(load_config(None, [*common, "run.max_steps=2", "train.gc_every=1"]),
                              create_plugin_manager())
    summary, _ = run_training(load_config(None, [*common, "run.max_steps=3", "train.gc_every=0"]),
                              create_plugin_manager(), resume=str(run_dir))
    assert summary["steps"] == 3
