"""Files: atomic writes (a killed run leaves the old file or the new one, never half of
one) and the folder headlab caches conversions and builds in."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    """``HEADLAB_CACHE``, else ``~/.cache/headlab``: GGUF conversions, built kernels."""
    return Path(os.environ.get("HEADLAB_CACHE", Path.home() / ".cache" / "headlab"))


@contextlib.contextmanager
def atomic_path(target: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``target``; rename it into place on success."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _naming(target):
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp",
                                   dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with _naming(target):
            # mkstemp makes 0600, and a writer may replace the file (safetensors does):
            # give the usual mode to whatever is there now
            os.chmod(tmp_path, 0o666 & ~_umask())
            with open(tmp_path, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp_path, target)
    finally:
        tmp_path.unlink(missing_ok=True)


@contextlib.contextmanager
def _naming(target: Path) -> Iterator[None]:
    """An OSError of the temporary file's own steps names ``target``, the file a user
    knows, not the hidden temporary name."""
    try:
        yield
    except OSError as exc:
        raise type(exc)(exc.errno, exc.strerror, str(target)) from exc


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a staging folder beside ``target`` (``.NAME.*.tmp``); on success it
    replaces ``target`` whole, so a killed or failed write never leaves half a folder."""
    import shutil

    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())
    try:
        yield staging
        if target.exists():  # a resumed run writes it again
            shutil.rmtree(target)
        os.replace(staging, target)
    except OSError as exc:  # name the file the user asked for, not the staging one
        if exc.filename is not None:
            exc.filename = str(exc.filename).replace(str(staging), str(target))
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def os_error(exc: BaseException, path: str | Path) -> BaseException:
    """A library's I/O failure (e.g. safetensors' "... (os error 28)") as the OSError
    it wraps, naming ``path``; anything else comes back unchanged."""
    import errno
    import re

    found = re.search(r"os error (\d+)", str(exc))
    if found is None or int(found.group(1)) not in errno.errorcode:
        return exc
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(path))


def atomic_write_text(target: str | Path, text: str) -> Path:
    with atomic_path(target) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def atomic_write_json(target: str | Path, data: Any) -> Path:
    return atomic_write_text(target, json.dumps(data, indent=2, allow_nan=False) + "\n")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
