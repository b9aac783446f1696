"""Atomic checkpoints: write a temporary file, fsync, rename. A crash mid-save leaves the old one.

A checkpoint is one ``torch.save`` file (``checkpoint.pt`` in the run folder) holding a dict with
at least :data:`REQUIRED_KEYS`; ``config`` is the run's config as a plain dict so a resume can
check that the configuration still fits (:func:`check_config`).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Mapping

import torch

FORMAT_VERSION = 1

#: what every gemcore training checkpoint holds
REQUIRED_KEYS = ("format_version", "step", "config", "model", "optimizer", "scheduler", "sampler",
                 "rng_torch", "rng_numpy", "rng_python")

#: config keys a resumed run may change: how long and how it runs, not what it computes
RESUME_MAY_CHANGE = {
    "run.name", "run.out_dir", "run.max_steps", "run.log_every", "run.eval_users", "run.threads",
    "run.device", "run.deterministic", "train.checkpoint_every", "train.max_time_s", "train.eval_every",
    "train.gc_every", "train.compile", "train.cuda_graphs", "plugins.disable",
}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, unreadable, incomplete, or for another config)."""


def save_atomic(state: dict[str, Any], path: str | Path) -> Path:
    """torch.save ``state`` to ``path`` atomically (same-folder temp file, fsync, os.replace).

    Until ``os.replace`` the old file at ``path`` is untouched; a process killed at any point
    leaves either the old or the new checkpoint, never a partial one (at worst a stray
    ``.checkpoint.pt.*.tmp`` file, which :func:`remove_stale_temporaries` deletes).
    """
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


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete temporary files a killed :func:`save_atomic` left beside ``path``; returns them."""
    path = Path(path)
    stale = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def load(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_atomic` (on CPU).

    Raises :class:`CheckpointError` naming the file when it is missing, unreadable or not a
    complete gemcore checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path}: no such file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, OSError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: expected a dict, found {type(state).__name__}")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {', '.join(missing)}")
    if state["format_version"] != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path}: format version {state['format_version']}, "
                              f"this gemcore reads version {FORMAT_VERSION}")
    return state


def _flatten(config: Mapping[str, Any]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def check_config(saved: Mapping[str, Any], current: Mapping[str, Any], path: str | Path) -> None:
    """Raise :class:`CheckpointError` if ``current`` differs from the checkpoint's ``saved`` config
    in a key a resumed run may not change (every key but :data:`RESUME_MAY_CHANGE`)."""
    old, new = _flatten(saved), _flatten(current)
    diffs = [f"{key} is {old.get(key, '<absent>')!r} in the checkpoint, {new.get(key, '<absent>')!r} now"
             for key in sorted(set(old) | set(new))
             if key not in RESUME_MAY_CHANGE and old.get(key) != new.get(key)]
    if diffs:
        raise CheckpointError(f"checkpoint {path} does not match the config: {'; '.join(diffs)}")
