"""One line about a finished `gem train` run: the median tokens/s of the second half's logged
windows (every 10th step row), the last loss and the held-out AUC.

    python scripts/run_summary.py runs/NAME
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(run_dir: str) -> None:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").open() if '"loss"' in line]
    late = sorted(r["tokens_per_s"] for r in rows[len(rows) // 2:][::10])
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    print("second-half median tokens/s:", round(late[len(late) // 2]), "last loss:", rows[-1]["loss"],
          "held-out AUC:", summary["auc"])


if __name__ == "__main__":
    main(sys.argv[1])
