"""Users' own data from JSONL or Parquet.

One record per user with the fields:

* ``user_id``: any (kept only for reference),
* ``items``: list[int] item ids of the history, oldest first,
* ``actions``: list[int] action type per event (same length as ``items``; optional, default 0),
* ``time_gaps``: list[float] seconds since the previous event (optional, default 0),
* ``candidates``: list[int] candidate item ids, at least one,
* ``labels``: list[0/1] click label per candidate (same length as ``candidates``).

Item ids must lie in ``[0, model.num_items)`` and actions in ``[0, model.num_actions)``; a record
that breaks a rule is a ``ValueError`` naming the line (or row), the field, the value and the
setting. docs/training.md ("Train on your own data") has a complete example.
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
        records = (("line", n, rec) for n, rec in _jsonl_records(path))
    elif source == "parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError("data.source = 'parquet' needs pyarrow: pip install 'gemcore[parquet]'") from None
        records = (("row", n, rec) for n, rec in enumerate(pq.read_table(path).to_pylist(), start=1))
    else:
        raise ValueError(f"data.source must be 'jsonl' or 'parquet', got {source!r}")
    return _build(records, num_items=num_items, num_actions=num_actions, time_buckets=time_buckets)


def _jsonl_records(path: Path) -> Iterable[tuple[int, dict]]:
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:  # one position: the file's line, the parser's column
                    raise ValueError(f"{path}: line {line_no}, column {exc.colno}: invalid JSON: {exc.msg}") from None


def _build(records, *, num_items: int, num_actions: int, time_buckets: int) -> JaggedDataset:
    cols: dict[str, list] = {k: [] for k in ("items", "actions", "time_gaps", "candidates", "labels")}
    lengths, cand_lengths = [], []
    for unit, number, rec in records:
        where = f"{unit} {number}"

        def fail(field: str, why: str):
            raise ValueError(f"{where}: field {field!r} {why}")
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object (one user), got {type(rec).__name__}")
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
        for field, ids in (("items", items), ("candidates", cands)):
            bad = next((i for i in ids if not (isinstance(i, int) and 0 <= i < num_items)), None)
            if bad is not None:
                fail(field, f"holds item id {bad!r}, outside [0, model.num_items = {num_items}); item ids "
                            f"must be integers in [0, model.num_items): set model.num_items above the "
                            f"largest id (--set model.num_items=N)")
        bad = next((a for a in actions if not (isinstance(a, int) and 0 <= a < num_actions)), None)
        if bad is not None:
            fail("actions", f"holds action {bad!r}, outside [0, model.num_actions = {num_actions}) "
                            f"(--set model.num_actions=N)")
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
