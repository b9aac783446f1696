"""One rank's share of a multi-rank smoke run, trained in a plain process: no process group, no FSDP.

``SHARE=r/w`` and ``--batch B``: step s trains on rank r's users of the w·B-user global batch of a
w-rank run with ``--batch w·B`` (``gemcore.planner.smoke`` gives rank r users r, r+w, ... of each
step's batch), so ``--predict`` compares that share's own measured and predicted step. Run the w
shares at once to load the cores as the ranks do; the w-rank run's step minus the slower share's
is what being a data-parallel rank costs (collectives, FSDP2's hooks and copies, DTensor).

    SHARE=1/2 OMP_NUM_THREADS=1 python scripts/rank_share_alone.py --predict --steps 6 --hidden 256 --blocks 2 --max-len 256 --batch 4 &
    SHARE=0/2 OMP_NUM_THREADS=1 python scripts/rank_share_alone.py --predict --steps 6 --hidden 256 --blocks 2 --max-len 256 --batch 4
"""
import os
import runpy
import sys

import gemcore.data.synthetic as synthetic

RANK, WORLD = map(int, os.environ["SHARE"].split("/"))
make_synthetic = synthetic.make_synthetic


class Share:
    """The data set seen through rank RANK's share: step s's B users become the w-rank run's."""

    def __init__(self, data):
        self._data = data

    def __getitems__(self, users):
        users = list(users)
        b = len(users)
        step = users[0] // b
        return self._data.__getitems__([WORLD * b * step + RANK + WORLD * j for j in range(b)])

    def __getattr__(self, name):
        return getattr(self._data, name)


def shared(*args, **kwargs):
    kwargs["num_users"] *= WORLD
    return Share(make_synthetic(*args, **kwargs))


synthetic.make_synthetic = shared
sys.argv = ["smoke", *sys.argv[1:]]
code = runpy.run_module("gemcore.planner.smoke", run_name="smoke")["main"]()
sys.stdout.flush()
os._exit(code)
