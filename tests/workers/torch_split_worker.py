"""Worker for tests/test_comms_split.py: nested splits of the torch backend, one half re-splitting alone."""
import torch
from gemcore import comms
c = comms.init("torch")
r = c.rank
halves = [[0, 1], [2, 3]]
sub = c.split(halves)
quarters = [[0], [1]]
subsub = sub.split(quarters)
x = sub.all_reduce(torch.tensor([float(r)]))
y = subsub.all_reduce(torch.tensor([float(r)]))
# a second split of the other half only (ranks 0,1 split their sub; ranks 2,3 do nothing else)
if r in (0, 1):
    again = sub.split([[0, 1]])
    z = again.all_reduce(torch.tensor([1.0]))
    assert z.item() == 2.0
expect = {0: 1.0, 1: 1.0, 2: 5.0, 3: 5.0}[r]
assert x.item() == expect, (r, x)
assert y.item() == float(r), (r, y)
c.barrier()
print(f"[rank {r}] split OK")
comms.finalize()
