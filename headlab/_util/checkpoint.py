"""Checkpoints of long loops, so an interrupted run resumes to the same result.

A checkpoint is one file per rank in the run directory holding named states (plain
tensors, numbers, strings, lists and dicts of them). It is written atomically and read
back with ``torch.load(weights_only=True)``, so a checkpoint file cannot run code.
Scoring saves its accumulators every ``every`` batches and when interrupted; iterative
pruning saves the mask, the curve and the scores after each step.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from headlab._util.io import atomic_path
from headlab.errors import UserError
from headlab.parallel import distributed


class Checkpoint:
    """Named states persisted in ``directory/checkpoint[-rankN].pt``."""

    def __init__(self, directory: str | Path, *, every: int = 10) -> None:
        if every < 1:
            raise UserError(f"checkpoint interval must be >= 1 batch, got {every}")
        rank = distributed.rank()
        name = "checkpoint.pt" if distributed.world_size() == 1 else f"checkpoint-rank{rank}.pt"
        self.path = Path(directory) / name
        self.every = every
        self._states: dict[str, Any] = {}
        if self.path.is_file():
            try:
                self._states = torch.load(self.path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise UserError(
                    f"checkpoint {self.path} cannot be read ({type(exc).__name__}); delete it "
                    "to start the run over"
                ) from exc

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
