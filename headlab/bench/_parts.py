"""The finished parts of a long benchmark, kept so that an interrupted run resumes.

``quality`` and ``recovery`` take hours on two cores, one model after another. Each
model's measurement is a part: when it ends, what it added to the `BenchResult` (its
figures' samples, targets, info lines, checks and method lines) is written to a
checkpoint beside the benchmark's JSON (``OUT/<name>.parts/``,
`headlab._util.checkpoint.Checkpoint`, keyed by the benchmark's sizes, preset, device and
library versions). ``headlab bench NAME --resume`` restores the parts found there, in
order, and measures only the others; a run without ``--resume`` starts over. The
checkpoint is removed once the benchmark completes. Every ratio a benchmark judges is
taken within one part, so parts measured on different days still compare like with like;
``checks["parts"]`` says when each part ran and how long it took. A benchmark whose parts
keep their raw measurements in checks (``quality``'s grids) judges them after the parts,
so a kept part is held to the bars as they are now.
"""

from __future__ import annotations

import copy
import logging
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from headlab._util.checkpoint import Checkpoint
from headlab.bench._common import BenchResult, Figure, Target, _jsonable

log = logging.getLogger(__name__)

__all__ = ["Parts", "measure_part"]


class Parts:
    """The parts of one benchmark run, kept in ``directory`` (see the module docstring)."""

    def __init__(self, directory: Path, identity: dict[str, Any], *, resume: bool) -> None:
        self.directory = Path(directory)
        if not resume and self.directory.exists():
            log.info("starting over: %s holds an earlier run's parts (--resume keeps them)",
                     self.directory)
            shutil.rmtree(self.directory)
        self._checkpoint = Checkpoint(self.directory, every=1, identity=identity)

    def run(self, res: BenchResult, key: str, measure: Callable[[], None]) -> None:
        """Restore part ``key`` into ``res`` if an earlier run finished it, else call
        ``measure()`` (which adds to ``res``) and keep what it added."""
        saved = self._checkpoint.get(key)
        if saved is not None:
            when = saved["checks"]["parts"][key]
            log.info("%s: kept from the run of %s (%.0f s)", key, when["date"],
                     when["seconds"])
            _restore(res, saved)
            return
        before = _State.of(res)
        t0 = time.perf_counter()
        measure()
        res.checks.setdefault("parts", {})[key] = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "seconds": round(time.perf_counter() - t0, 2)}
        self._checkpoint.put(key, before.added(res))

    def done(self) -> None:
        """The benchmark completed: its parts are in its JSON; remove the checkpoint."""
        self._checkpoint.clear()
        shutil.rmtree(self.directory, ignore_errors=True)


class _State:
    """What a `BenchResult` held before a part: its figure names, the numbers of its
    targets and info lines, and copies of its checks and method."""

    def __init__(self, figures: set[str], targets: int, info: int, checks: dict,
                 method: dict) -> None:
        self.figures, self.targets, self.info = figures, targets, info
        self.checks, self.method = checks, method

    @classmethod
    def of(cls, res: BenchResult) -> _State:
        return cls(set(res.figures), len(res.targets), len(res.info),
                   copy.deepcopy(res.checks), dict(res.method))

    def added(self, res: BenchResult) -> dict[str, Any]:
        """What ``res`` gained since: new figures (samples and unit), targets and info
        lines, and the checks and method lines that are new or changed (whole values: a
        list a part extends is kept as it stands after the part)."""
        return {
            "method": {k: v for k, v in res.method.items() if self.method.get(k) != v},
            "figures": {k: {"samples": list(f.samples), "unit": f.unit}
                        for k, f in res.figures.items() if k not in self.figures},
            "targets": [asdict(t) for t in res.targets[self.targets:]],
            "info": [list(x) for x in res.info[self.info:]],
            # as the JSON will hold them: plain values, which the checkpoint reads back
            "checks": {k: _jsonable(v) for k, v in res.checks.items()
                       if k not in self.checks or self.checks[k] != v},
        }


def _restore(res: BenchResult, part: dict[str, Any]) -> None:
    for name, fig in part["figures"].items():
        res.figures[name] = Figure.of(fig["samples"], fig["unit"])
    res.targets += [Target(**t) for t in part["targets"]]
    res.info += [(figure, what) for figure, what in part["info"]]
    res.checks.update(copy.deepcopy(part["checks"]))
    res.method.update(part["method"])


def measure_part(parts: Parts | None, res: BenchResult, key: str,
                 measure: Callable[[], None]) -> None:
    """``parts.run(res, key, measure)``; with no parts (a benchmark called directly),
    ``measure()``."""
    if parts is None:
        measure()
    else:
        parts.run(res, key, measure)
