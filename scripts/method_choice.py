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
import json
import sys
from dataclasses import replace
from pathlib import Path

from headlab._util.timing import pinned_threads
from headlab.bench import ModelCache, bench_context, run_one
from headlab.bench.quality import QualitySizes, bench_quality

PRESET = "method-choice"
SIZES = QualitySizes(keeps=(0.6,), methods=("michel", "taylor", "gates", "flap"), seeds=(0,),
                     validate=())


def run(out: Path, models: list[str], *, seq_len: int = 128, tokens: int = 4096,
        sizes: QualitySizes = SIZES, device: str = "cpu") -> list[Path]:
    """One ``quality-<model>.json`` per model under ``out``, written as ``headlab bench``
    writes its JSONs (`headlab.bench.run_one`, the preset named ``method-choice``):
    ``sizes`` on ``tokens`` scoring tokens of the model in blocks of ``seq_len``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"quality-{name}.json" for name in models]
    cache = ModelCache(device)
    try:
        with pinned_threads():
            for name, path in zip(models, paths, strict=True):
                run_one("quality", bench_quality, replace(sizes, runs=((name, seq_len, tokens),)),
                        device=device, cache=cache, context=bench_context(PRESET, device),
                        path=path)
    finally:
        cache.close()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the JSONs")
    parser.add_argument("models", nargs="+", help="bundled model names")
    args = parser.parse_args()
    failed = False
    for path in run(args.out, args.models):
        error = json.loads(path.read_text())["error"]
        print(path if error is None else f"{path}: failed: {error}")
        failed = failed or error is not None
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
