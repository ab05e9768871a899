"""Running `headlab ARGS` in this process as the console script does, and the shape of
a refusal: exit code 2 and one line naming the culprit."""

from __future__ import annotations

import sys


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `headlab ARGS` through the console script's entry point in this process."""
    from headlab import cli as cli_module

    argv = sys.argv
    sys.argv = ["headlab", *args]
    try:
        cli_module.main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code: int, err: str, culprit: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and culprit in lines[0], err
    assert "Traceback" not in err
