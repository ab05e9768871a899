"""Which local lm-eval task YAMLs would run code, found without running any.

lm-eval's task YAMLs may import Python: ``!function module.fn`` imports ``module.py``
beside the YAML and calls it, ``class:`` names a task class, a dataset loaded with
``trust_remote_code`` runs the dataset's script, and a Jinja template reaching Python's
internals (``x.__globals__``, ...) runs what it likes. A folder of task YAMLs is data a
user may have been handed; like transformers' ``trust_remote_code``, its code runs only
when the user says so (``--trust-task-code``). `check_task_code` reads the YAMLs with a
safe loader that records the tags instead of resolving them, before lm-eval indexes the
folder, so a refusal leaves nothing imported. lm-eval's own tasks are trusted.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from headlab.errors import UserError

__all__ = ["check_task_code"]

TRUST_FLAG = "--trust-task-code"
_SUFFIXES = (".yaml", ".yml")
_TAG = "\0tag"  # the key a recorded tag is kept under
_JINJA = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
# inside a template: x._a, x['_a'], x|attr(...): the way from a value to its module
_PRIVATE = re.compile(r"\.\s*_|[\w)\]]\s*\[\s*['\"]_|\battr\s*\(")


class _Recording(yaml.SafeLoader):
    """A safe loader that keeps every non-standard tag as a marker, not an object."""


def _record(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> dict[str, str]:
    return {_TAG: node.tag}


_Recording.add_multi_constructor("!", _record)
_Recording.add_multi_constructor("tag:yaml.org,2002:python/", _record)


def check_task_code(include_path: str | Path, *, trust: bool) -> None:
    """Raise a one-line UserError naming the first YAML under ``include_path`` (or a
    YAML it includes) that would run code, unless ``trust``."""
    if trust:
        return
    for path in sorted(p for p in Path(include_path).rglob("*") if p.suffix in _SUFFIXES):
        _check_file(path, set())


def _check_file(path: Path, seen: set[Path]) -> None:
    path = path.resolve()
    if path in seen or _builtin(path) or not path.is_file():
        return  # a cycle or a missing include is lm-eval's to report; its own tasks are trusted
    seen.add(path)
    try:
        doc = yaml.load(path.read_bytes(), Loader=_Recording)  # noqa: S506 (safe, recording)
    except (yaml.YAMLError, RecursionError, UnicodeDecodeError) as exc:
        raise UserError(f"task YAML {path} cannot be read ({type(exc).__name__}); fix or "
                        "remove it") from None
    why = _code_in(doc)
    if why is not None:
        raise UserError(f"task YAML {path} would run Python code ({why}); read it, then "
                        f"pass {TRUST_FLAG} to allow it")
    includes = doc.get("include") if isinstance(doc, dict) else None
    for inc in includes if isinstance(includes, list) else [includes]:
        if isinstance(inc, str):
            _check_file(Path(inc) if Path(inc).is_absolute() else path.parent / inc, seen)


def _code_in(node: Any, depth: int = 0) -> str | None:
    """Why ``node`` (a parsed YAML value) would run code, or None."""
    if depth > 200:
        return "nesting deeper than 200 levels"
    if isinstance(node, dict):
        if _TAG in node:
            return f"the tag {node[_TAG]}"
        for key, value in node.items():
            if key == "class":
                return "a task class, class:"
            if key == "trust_remote_code" and value:
                return "a dataset script, trust_remote_code"
            found = _code_in(value, depth + 1)
            if found is not None:
                return found
    elif isinstance(node, list):
        for value in node:
            found = _code_in(value, depth + 1)
            if found is not None:
                return found
    elif isinstance(node, str) and any(_PRIVATE.search(block)
                                       for block in _JINJA.findall(node)):
        return "a template reaching Python internals through an _attribute"
    return None


def _builtin(path: Path) -> bool:
    import importlib.util

    spec = importlib.util.find_spec("lm_eval")
    if spec is None or spec.origin is None:
        return False
    return path.is_relative_to(Path(spec.origin).resolve().parent / "tasks")
