"""Python's garbage collector on a step schedule while training.

CPython collects whenever container allocations cross a threshold, so a collection lands inside
some steps and not others. Once torch and Triton are imported a process tracks ~300k objects; a
full (generation-2) pass over them took ~37 ms on the 2-core CI machine, a generation-1 pass
~0.6 ms: on a GPU step of 10-20 ms that the host issues (small models), either is step-time
jitter. A training loop therefore turns automatic collection off and collects the young
generations itself every N steps, as TorchTitan does (``training.gc_freq``)::

    with ScheduledGC(every=50) as gc_schedule:
        for step in range(1, steps + 1):
            train_step()
            gc_schedule.step(step)
"""
from __future__ import annotations

import gc


class ScheduledGC:
    """Inside the ``with`` block (or between :meth:`start` and :meth:`stop`) automatic collection
    is off, except with ``every == 0`` (then nothing changes); :meth:`step` collects generations 0
    and 1 after every ``every``-th step. On exit the collector is enabled again if it was before
    (nesting keeps the outer choice)."""

    def __init__(self, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"ScheduledGC: every must be an int >= 0 (steps; 0: automatic), got {every!r}")
        self.every = every
        self.collections = 0          #: scheduled collections run so far
        self._was_enabled = False

    def start(self) -> "ScheduledGC":
        """Automatic collection off (what ``with`` does on entry)."""
        if self.every:
            self._was_enabled = gc.isenabled()
            gc.collect(1)             # start with the young generations empty
            gc.disable()
        return self

    __enter__ = start

    def step(self, step: int) -> None:
        """Call after step ``step`` (counting from 1) has been issued."""
        if self.every and step % self.every == 0:
            gc.collect(1)
            self.collections += 1

    def stop(self) -> None:
        """Automatic collection back on if it was on before :meth:`start` (what ``with`` does on
        exit)."""
        if self.every and self._was_enabled:
            gc.enable()
        self._was_enabled = False

    def __exit__(self, *exc) -> None:
        self.stop()
