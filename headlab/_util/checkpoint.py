"""Checkpoints of long loops, so an interrupted run resumes to the same result.

A checkpoint is one file per rank in the run directory holding named states (plain
tensors, numbers, strings, lists and dicts of them). It is written atomically and read
back with ``torch.load(weights_only=True)``, so a checkpoint file cannot run code.
Scoring saves its accumulators every ``every`` batches and when interrupted; iterative
pruning saves the mask, the curve and the scores after each step.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch

from headlab._util.io import atomic_path
from headlab.errors import UserError
from headlab.parallel import distributed

IDENTITY = "identity"  # what the run is (`headlab.runs.identity`), saved beside its states


class Checkpoint:
    """Named states persisted in ``directory/checkpoint[-rankN].pt``."""

    def __init__(self, directory: str | Path, *, every: int = 10,
                 identity: dict[str, Any] | None = None) -> None:
        if every < 1:
            raise UserError(f"checkpoint interval must be >= 1 batch, got {every}")
        self.path = _path(directory)
        self.every = every
        self._states: dict[str, Any] = _read(self.path) if self.path.is_file() else {}
        if identity is not None:
            _compare(self.path, self._states, identity)
            self._states[IDENTITY] = identity


    def get(self, key: str) -> Any | None:
        return self._states.get(key)

    def put(self, key: str, state: Any) -> None:
        """Record a copy of ``state`` under ``key`` and write the file. A copy: a live
        list saved here would change with the caller and be written half-updated by
        the next ``put`` of another key."""
        self._states[key] = copy.deepcopy(state)
        with atomic_path(self.path) as tmp:
            torch.save(self._states, tmp)

    def clear(self) -> None:
        """Remove the file once the run is complete."""
        self._states = {}
        self.path.unlink(missing_ok=True)


def check_identity(directory: str | Path, identity: dict[str, Any]) -> None:
    """Refuse (one line, naming the key) a checkpoint in ``directory`` that another run
    wrote: one whose recorded identity differs from ``identity`` in any of its keys."""
    path = _path(directory)
    if path.is_file():
        _compare(path, _read(path), identity)


def _path(directory: str | Path) -> Path:
    rank = distributed.rank()
    name = "checkpoint.pt" if distributed.world_size() == 1 else f"checkpoint-rank{rank}.pt"
    return Path(directory) / name


def _read(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise UserError(f"checkpoint {path} cannot be read ({type(exc).__name__}); delete it "
                        "to start the run over") from exc


def _compare(path: Path, states: dict[str, Any], identity: dict[str, Any]) -> None:
    if not states:
        return
    stored = states.get(IDENTITY)
    if stored is None:  # written before checkpoints recorded their run: still resumable
        logging.getLogger("headlab").warning(
            "checkpoint %s predates identity records: it cannot be checked against the "
            "configuration, and resumes as the run's config.json says", path)
        return
    if not isinstance(stored, dict):
        raise UserError(f"checkpoint {path} records no readable run identity; delete it to "
                        "start the run over")
    for key, value in identity.items():
        if stored.get(key) != value:
            raise UserError(
                f"checkpoint {path} belongs to another run: {key} was "
                f"{_short(stored.get(key))}, the configuration now says {_short(value)}; "
                "restore it, or start a new run (another --out)")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
