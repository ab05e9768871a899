"""Which process does what in a run: the one place where a single process, torchrun's
ranks sharing the data, and ranks sharing FSDP-sharded weights part ways."""

from __future__ import annotations

from dataclasses import dataclass

from headlab.models.base import HeadModel
from headlab.parallel import distributed
from headlab.parallel.sharding import is_sharded


@dataclass(frozen=True)
class Placement:
    """This process's part in a run.

    A single process does everything. Under torchrun every rank computes and rank 0
    alone writes (files, status, the summary). With the weights sharded (FSDP) every
    rank must take part in each forward, so the analyses run on every rank, and no rank
    holds a whole model to time or to save in one piece.
    """

    main: bool  # rank 0 (or the only process)
    sharded: bool  # the model's weights are split across the ranks

    @classmethod
    def here(cls, model: HeadModel | None = None) -> Placement:
        """This process's placement; before a model is loaded, ``sharded`` is False."""
        return cls(main=distributed.is_main(), sharded=model is not None and is_sharded(model))

    @property
    def writes(self) -> bool:
        """Writes the run directory's files and reports."""
        return self.main

    @property
    def analyses(self) -> bool:
        """Runs the head overview and detectors (a forward every shard takes part in)."""
        return self.main or self.sharded

    @property
    def holds_whole(self) -> bool:
        """Holds the whole model on rank 0: times it and saves it in one piece."""
        return self.main and not self.sharded
