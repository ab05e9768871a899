"""Write the README's family capability table from the conformance matrix's knowledge:
the families and features of tests/_families.py and what each family declares it
cannot do (`HeadModel.not_applicable`, its kind, its HF export), between the markers
``<!-- capabilities:start -->`` and ``<!-- capabilities:end -->``.

    python scripts/capability_table.py            # rewrite README.md's table
    python scripts/capability_table.py --check    # exit 1 if README.md's table is stale

tests/test_conformance.py fails while the README's table and the matrix disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]

from _families import capability_table, readme_table  # noqa: E402
from generated_block import update  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("readme", nargs="?", default=str(ROOT / "README.md"))
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 if the table is stale")
    args = parser.parse_args(argv)
    return update(Path(args.readme), readme_table, capability_table(), check=args.check,
                  what="capability table",
                  markers="<!-- capabilities:start --> and <!-- capabilities:end -->",
                  script="scripts/capability_table.py")

if __name__ == "__main__":
    sys.exit(main())
