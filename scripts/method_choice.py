"""The run behind docs/prune-and-repair.md's choice of the default ``--method``:
``headlab bench quality`` at keep 0.6 alone, for michel, taylor, the learned gates and
FLAP's metric (with one random seed beside them), each model in its own JSON.

    python scripts/method_choice.py reports/bench/method-choice smollm2-135m gemma3-270m

About 12 minutes for SmolLM2 and 30 for Gemma-3 on two idle cores; as with
``headlab bench``, run it with nothing else on the machine and without
OMP_WAIT_POLICY=PASSIVE.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from headlab._util.io import atomic_write_json
from headlab._util.timing import machine_info, pinned_threads
from headlab.bench._common import versions
from headlab.bench.quality import QualitySizes, bench_quality

PRESET = "method-choice"
SIZES = QualitySizes(keeps=(0.6,), methods=("michel", "taylor", "gates", "flap"), seeds=(0,),
                     validate=())


def run(out: Path, models: list[str], *, seq_len: int = 128, tokens: int = 4096,
        sizes: QualitySizes = SIZES, device: str = "cpu") -> list[Path]:
    """One ``quality-<model>.json`` per model under ``out``, as ``headlab bench`` writes
    its JSONs (the preset named ``method-choice``): ``sizes`` on ``tokens`` scoring
    tokens of the model in blocks of ``seq_len``."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in models:
        one = replace(sizes, runs=((name, seq_len, tokens),))
        context = {"preset": PRESET, "device": device, "versions": versions(),
                   "date": datetime.now(UTC).isoformat(timespec="seconds")}
        with pinned_threads():
            machine = machine_info(device)
            start = time.perf_counter()
            result = bench_quality(one, device=device)
            result.elapsed_s = time.perf_counter() - start
            machine["load_average_after"] = machine_info(device)["load_average"]
        written.append(atomic_write_json(out / f"quality-{name}.json",
                                         result.to_json({**context, "machine": machine})))
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the JSONs")
    parser.add_argument("models", nargs="+", help="bundled model names")
    args = parser.parse_args()
    for path in run(args.out, args.models):
        print(path)


if __name__ == "__main__":
    main()
