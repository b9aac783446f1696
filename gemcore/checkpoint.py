"""Atomic checkpoints: write a temporary file, fsync, rename. A crash mid-save leaves the old one."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """torch.save ``state`` to ``path`` atomically (same-folder temp file, fsync, os.replace)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_atomic` (on CPU)."""
    return torch.load(Path(path), map_location="cpu", weights_only=False)
