"""Users' own data from JSONL or Parquet.

One record per user with the fields:

* ``user_id``: any (kept only for reference),
* ``items``: list[int] item ids of the history, oldest first,
* ``actions``: list[int] action type per event (same length as ``items``; optional, default 0),
* ``time_gaps``: list[float] seconds since the previous event (optional, default 0),
* ``candidates``: list[int] candidate item ids, at least one,
* ``labels``: list[0/1] click label per candidate (same length as ``candidates``).

Item ids must lie in ``[0, model.num_items)`` and actions in ``[0, model.num_actions)``; a record
that breaks a rule is a ``ValueError`` naming the line (or row) and the field.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import numpy as np

from gemcore.data.dataset import JaggedDataset


def load_user_data(path: str | Path, *, source: str, num_items: int, num_actions: int,
                   time_buckets: int = 32) -> JaggedDataset:
    """Read ``path`` (``source`` = "jsonl" or "parquet") into a :class:`JaggedDataset`."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"data.path: no such file {str(path)!r}")
    if source == "jsonl":
        records = _jsonl_records(path)
    elif source == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("data.source = 'parquet' needs pyarrow: pip install 'gemcore[parquet]'") from None
        records = enumerate(pq.read_table(path).to_pylist(), start=1)
    else:
        raise ValueError(f"data.source must be 'jsonl' or 'parquet', got {source!r}")
    return _build(records, num_items=num_items, num_actions=num_actions, time_buckets=time_buckets)


def _jsonl_records(path: Path) -> Iterable[tuple[int, dict]]:
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: invalid JSON: {exc}") from None


def _build(records, *, num_items: int, num_actions: int, time_buckets: int) -> JaggedDataset:
    cols: dict[str, list] = {k: [] for k in ("items", "actions", "time_gaps", "candidates", "labels")}
    lengths, cand_lengths = [], []
    for where, rec in records:
        def fail(field: str, why: str):
            raise ValueError(f"record {where}: field {field!r} {why}")
        for field in ("items", "candidates", "labels"):
            if field not in rec:
                fail(field, "is missing")
        items, cands, labels = list(rec["items"]), list(rec["candidates"]), list(rec["labels"])
        actions = list(rec.get("actions") or [0] * len(items))
        gaps = list(rec.get("time_gaps") or [0.0] * len(items))
        if len(actions) != len(items):
            fail("actions", f"has {len(actions)} entries, items has {len(items)}")
        if len(gaps) != len(items):
            fail("time_gaps", f"has {len(gaps)} entries, items has {len(items)}")
        if not cands:
            fail("candidates", "is empty")
        if len(labels) != len(cands):
            fail("labels", f"has {len(labels)} entries, candidates has {len(cands)}")
        if any(not 0 <= i < num_items for i in items + cands):
            fail("items/candidates", f"holds an id outside [0, {num_items})")
        if any(not 0 <= a < num_actions for a in actions):
            fail("actions", f"holds a value outside [0, {num_actions})")
        if any(lbl not in (0, 1) for lbl in labels):
            fail("labels", "holds a value other than 0 or 1")
        for key, value in (("items", items), ("actions", actions), ("time_gaps", gaps),
                           ("candidates", cands), ("labels", labels)):
            cols[key].extend(value)
        lengths.append(len(items))
        cand_lengths.append(len(cands))
    if not lengths:
        raise ValueError("data.path holds no records")
    return JaggedDataset.from_arrays(
        lengths=np.array(lengths), cand_lengths=np.array(cand_lengths),
        item_ids=np.array(cols["items"], dtype=np.int64), actions=np.array(cols["actions"], dtype=np.int64),
        time_gaps=np.array(cols["time_gaps"], dtype=np.float64),
        cand_ids=np.array(cols["candidates"], dtype=np.int64),
        labels=np.array(cols["labels"], dtype=np.float32), time_buckets=time_buckets)
