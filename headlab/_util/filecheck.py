"""Checks of the files a user hands headlab, made before anything is allocated from them.

A model file is read by its header alone and the header checked against the file's
length (safetensors offsets and sizes, GGUF counts, tensor extents), so a truncated or
random file ends in `CorruptFileError` naming it instead of a library's traceback or an
allocation the size of a lie. Data files are checked to be text (UTF-8, no control
bytes) and, for JSON lines and CSV, parsed row by row so that an error names its line.
Dataset specs are checked by their grammar before anything asks the hub.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import re
import struct
from pathlib import Path
from typing import Any

from headlab.errors import CorruptFileError, DataError

_RESTORE = "download or copy it again"

# ---------------------------------------------------------------- safetensors
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2,
                "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
                "F8_E4M3": 1, "F8_E5M2": 1}
_ST_MAX_HEADER = 100_000_000  # the safetensors library's own limit


def check_safetensors(path: str | Path) -> None:
    """Raise CorruptFileError unless ``path``'s header is valid JSON whose tensors
    exactly tile the bytes after it, each as long as its dtype and shape say."""
    path = Path(path)
    size = path.stat().st_size

    def corrupt(why: str) -> CorruptFileError:
        return CorruptFileError(f"truncated or corrupt: {path} ({why}); {_RESTORE}",
                                path=str(path))

    if size < 8:
        raise corrupt(f"{size} bytes, shorter than the 8-byte header length")
    with open(path, "rb") as f:
        (n_header,) = struct.unpack("<Q", f.read(8))
        if n_header > min(size - 8, _ST_MAX_HEADER):
            raise corrupt(f"the header claims {n_header} bytes, the file has {size}")
        raw = f.read(n_header)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise corrupt("the header is not valid JSON") from None
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            if not all(isinstance(d, int) and d >= 0 for d in (*shape, begin, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise corrupt(f"tensor {name!r} has no valid dtype, shape and data_offsets") from None
        if dtype in _ST_ITEMSIZE and end - begin != math.prod(shape) * _ST_ITEMSIZE[dtype]:
            raise corrupt(f"tensor {name!r} {dtype}{shape} spans {end - begin} bytes")
        spans.append((begin, end, name))
    data = size - 8 - n_header
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at or end > data:
            raise corrupt(f"tensor {name!r} lies at bytes {begin}..{end} of {data} data bytes")
        at = end
    if at != data:
        raise corrupt(f"the tensors cover {at} of its {data} data bytes")


# ---------------------------------------------------------------- GGUF
# value type -> struct format of the scalar types (strings and arrays are read apart)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?",
                 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


class _Reader:
    """Bounded little-endian reads: running past the end is a corrupt file."""

    def __init__(self, buf, corrupt) -> None:
        self.buf, self.at, self.corrupt = buf, 0, corrupt

    def take(self, n: int) -> bytes:
        if n < 0 or self.at + n > len(self.buf):
            raise self.corrupt(f"a field at byte {self.at} runs past the end of the file")
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def scalar(self, fmt: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("Q")).decode("utf-8", errors="replace")

    def value(self, kind: int, depth: int = 0) -> Any:
        if kind in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[kind])
        if kind == _GGUF_STRING:
            return self.string()
        if kind == _GGUF_ARRAY and depth == 0:
            item, count = self.scalar("I"), self.scalar("Q")
            least = struct.calcsize(_GGUF_SCALARS[item]) if item in _GGUF_SCALARS else 8
            if count * least > len(self.buf) - self.at:
                raise self.corrupt(f"an array of {count} values at byte {self.at} is longer "
                                   "than the file")
            if item in _GGUF_SCALARS:  # skipped whole: metadata arrays are not needed here
                self.take(count * least)
                return None
            for _ in range(count):
                self.value(item, depth + 1)
            return None
        raise self.corrupt(f"unknown value type {kind} at byte {self.at}")


def read_gguf_header(path: str | Path) -> dict[str, Any]:
    """The scalar metadata of a GGUF file, after checking its counts, every field and
    every tensor's extent against the file's length (CorruptFileError otherwise)."""
    from gguf.constants import GGML_QUANT_SIZES

    path = Path(path)
    size = path.stat().st_size

    def corrupt(why: str) -> CorruptFileError:
        return CorruptFileError(f"truncated or corrupt: {path} ({why}); {_RESTORE}",
                                path=str(path))

    with open(path, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise corrupt("not a GGUF file: no GGUF magic and 24-byte header")
        version, n_tensors, n_kv = struct.unpack("<IQQ", f.read(20))
        if version not in (2, 3):
            raise corrupt(f"GGUF version {version}; headlab reads versions 2 and 3")
        # each key-value pair takes >= 13 bytes, each tensor description >= 24
        if 24 + 13 * n_kv + 24 * n_tensors > size:
            raise corrupt(f"the header lists {n_kv} metadata fields and {n_tensors} tensors, "
                          f"more than {size} bytes can hold")
        import mmap

        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta, tensors, data_start = _gguf_body(_Reader(mm, corrupt), n_kv, n_tensors,
                                                   corrupt)
    for name, dims, kind, offset in tensors:
        if kind not in GGML_QUANT_SIZES:
            raise corrupt(f"tensor {name!r} has unknown type {kind}")
        block, type_size = GGML_QUANT_SIZES[kind]
        nbytes = math.prod(dims) // block * type_size
        if data_start + offset + nbytes > size:
            raise corrupt(f"tensor {name!r} ends at byte {data_start + offset + nbytes}, "
                          f"the file has {size}")
    return meta


def _gguf_body(r: _Reader, n_kv: int, n_tensors: int, corrupt):
    r.take(24)
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string()
        meta[key] = r.value(r.scalar("I"))
    tensors = []
    for _ in range(n_tensors):
        name = r.string()
        n_dims = r.scalar("I")
        if n_dims > 8:
            raise corrupt(f"tensor {name!r} claims {n_dims} dimensions")
        dims = [r.scalar("Q") for _ in range(n_dims)]
        tensors.append((name, dims, r.scalar("I"), r.scalar("Q")))
    align = meta.get("general.alignment", 32)
    if not isinstance(align, int) or align < 1:
        raise corrupt(f"general.alignment is {align!r}")
    return meta, tensors, -(-r.at // align) * align


# ---------------------------------------------------------------- config.json
def read_config(path: str | Path, *, what: str = "config") -> dict[str, Any]:
    """A config.json (a model's, a run's: ``what``) as a dict, or CorruptFileError
    naming the file and line."""
    path = Path(path)
    try:
        config = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CorruptFileError(f"broken {what}: {path} is not UTF-8 text (byte {exc.start}); "
                               f"{_RESTORE}", path=str(path)) from None
    except json.JSONDecodeError as exc:
        raise CorruptFileError(f"broken {what}: {path} line {exc.lineno} column {exc.colno}: "
                               f"{exc.msg}; fix the JSON or {_RESTORE}", path=str(path)) from None
    except RecursionError:
        raise CorruptFileError(f"broken {what}: {path} nests deeper than JSON readers go; "
                               f"{_RESTORE}", path=str(path)) from None
    if not isinstance(config, dict):
        raise CorruptFileError(f"broken {what}: {path} holds a JSON {type(config).__name__}, "
                               f"not an object; {_RESTORE}", path=str(path))
    return config


# ---------------------------------------------------------------- data
MAX_INVALID_UTF8 = 0.01  # fraction of bytes that may be invalid UTF-8 (a stray byte or two)
MAX_CONTROL = 0.001  # fraction of characters that may be control characters (no NUL)
_CONTROL = re.compile("[\x00-\x08\x0e-\x1f\x7f]")  # tab, newlines, \v and \f are text
_INVALID = re.compile("[\udc80-\udcff]")  # bytes surrogateescape could not decode


def read_text(path: str | Path) -> str:
    """The text of a data file, refused (DataError naming the file and the byte offset)
    when it is not text: invalid UTF-8 beyond ``MAX_INVALID_UTF8`` of the bytes, a NUL,
    or control characters beyond ``MAX_CONTROL``. Stray invalid bytes become U+FFFD."""
    path = Path(path)
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="surrogateescape")
    invalid = _INVALID.findall(text)
    control = _CONTROL.findall(text)

    def offset(pattern: re.Pattern) -> int:
        first = pattern.search(text)
        return len(text[:first.start()].encode("utf-8", errors="surrogateescape"))

    if len(invalid) > MAX_INVALID_UTF8 * len(raw):
        raise DataError(f"data file {path} is not text: {len(invalid)} of its {len(raw)} bytes "
                        f"are not valid UTF-8 (the first at byte {offset(_INVALID)}); give "
                        "UTF-8 text")
    if "\x00" in control or len(control) > MAX_CONTROL * max(len(text), 1):
        raise DataError(f"data file {path} is not text: {len(control)} control characters "
                        f"(the first at byte {offset(_CONTROL)}); give plain UTF-8 text")
    return _INVALID.sub("\ufffd", text)


def check_rows_file(path: str | Path) -> None:
    """Check a .jsonl/.json/.csv/.tsv file as text, then parse it, naming the line of
    the first broken row (DataError)."""
    path = Path(path)
    text = read_text(path)
    suffix = path.suffix.lower()
    if suffix in (".csv", ".tsv"):
        _check_csv(path, text, "\t" if suffix == ".tsv" else ",")
        return
    if suffix == ".json":
        with contextlib.suppress(json.JSONDecodeError):
            try:
                json.loads(text)  # a whole JSON document; else it must be JSON lines
            except RecursionError:
                raise DataError(f"could not read {path}: it nests deeper than JSON readers "
                                "go") from None
            return
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"could not read {path} line {number}: not valid JSON ({exc.msg} "
                            f"at column {exc.colno}); fix or remove that line") from None
        except RecursionError:
            raise DataError(f"could not read {path} line {number}: it nests deeper than "
                            "JSON readers go; fix or remove that line") from None
        if not isinstance(row, dict):
            raise DataError(f"could not read {path} line {number}: a JSON "
                            f"{type(row).__name__}, not an object with named fields; each line "
                            "must be one {\"text\": ...} object")


def _check_csv(path: Path, text: str, delimiter: str) -> None:
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # a long document in one field is still a row
    try:
        reader = csv.reader(text.splitlines(keepends=True), delimiter=delimiter, strict=True)
        width = None
        for row in reader:
            if width is None:
                width = len(row)
            elif row and len(row) != width:
                raise DataError(f"could not read {path} line {reader.line_num}: {len(row)} "
                                f"fields, the header has {width}; quote fields that hold "
                                f"{delimiter!r}")
    except csv.Error as exc:
        raise DataError(f"could not read {path} line {reader.line_num}: {exc} (an "
                        "unterminated quote?); fix that row") from None
    finally:
        csv.field_size_limit(limit)


_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_HUB_CONFIG = re.compile(r"[\w.-]*")
_HUB_SPLIT = re.compile(r"[A-Za-z][\w.+%\[\]-]*")


def check_dataset_spec(spec: str) -> None:
    """Refuse a hub dataset spec that is not ``name[:config[:split]]`` (DataError)."""
    parts = spec.split(":")
    name, config, split = (parts + [None, None])[:3]
    ok = (len(parts) <= 3 and _HUB_NAME.fullmatch(name)
          and (config is None or _HUB_CONFIG.fullmatch(config))
          and (split is None or _HUB_SPLIT.fullmatch(split)))
    if not ok:
        raise DataError(
            f"--data {spec!r} is not a dataset spec: a Hugging Face dataset is "
            "name:config:split (e.g. wikitext:wikitext-2-raw-v1:test; config and split "
            "optional), a file ends in .txt/.jsonl/.csv/.tsv")
