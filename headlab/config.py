"""What a run is made of: `RunConfig` (CLI flags and TOML recipes set its keys), its
validation, device and dtype resolution, and recipe loading.

The CLI reads its defaults and choices from here, so a default is stated once.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from headlab.errors import UserError
from headlab.importance import METHODS, PER_TOKEN_METHODS
from headlab.objectives import DEFAULT_BATCH_SIZE
from headlab.recovery import RECOVERY_METHODS, TRAINING_FREE
from headlab.recovery.distill import PARAMS as RECOVER_PARAMS

SCHEDULES = ("iterative", "one-shot")
DEVICES = ("auto", "cpu", "cuda")

COMMANDS = ("prune", "score", "eval")


@dataclass
class RunConfig:
    """Everything that defines a run; recipes and CLI flags set these keys."""

    model: str
    command: str = "prune"
    method: str = "michel"
    compare: list[str] = field(default_factory=list)  # more methods, one curve each
    keep: float | None = None
    prune: int | None = None
    schedule: str = "iterative"
    step: float = 0.1
    per_layer: bool = False
    min_heads_per_layer: int = 0
    data: str | None = None
    text_column: str | None = None
    label_column: str | None = None
    max_tokens: int = 16384
    seq_len: int | None = None
    batch_size: int = DEFAULT_BATCH_SIZE
    heldout: float = 0.5
    seed: int = 0
    normalize: bool | None = None  # None: the method's default (see importance.score)
    global_minmax: bool = False  # rescale all scores to [0, 1] (the ranking is unchanged)
    per_token: bool = False
    probes: int = 4  # taylor's curvature probes per batch
    device: str = "auto"
    dtype: str = "float32"
    out: str | None = None
    overwrite: bool = False
    export: str | None = None
    # what repairs the pruned model; the default is measured (README, "Prune and repair")
    recover: str = "lsq"
    recover_ridge: float | None = None  # lsq, rescale: None is the measured default
    recover_tokens: int | None = None  # distill: token budget; None is one pass
    recover_params: str = "out"  # distill: what trains
    recover_lr: float = 1e-4  # distill
    recover_temperature: float = 1.0  # distill
    recover_every_step: bool = False  # repair after each step too, before re-scoring
    sample_tokens: int = 64
    checkpoint_every: int = 10
    latency_batch: int = 4
    latency_seq_len: int = 128

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise UserError(f"unknown key(s) {unknown}; known keys: {', '.join(sorted(known))}")
        if "model" not in d:
            raise UserError("a run needs a model (model = \"smollm2-135m\", or --model)")
        return cls(**d).validated()

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each key's default, for the CLI; keys without a plain default are left out."""
        return {f.name: f.default for f in fields(cls)
                if f.default is not dataclasses.MISSING}

    def validated(self) -> RunConfig:
        """Check types and ranges; raise UserError naming the key."""
        for f in fields(self):
            _check_type(f.name, str(f.type), getattr(self, f.name))
        if not self.model:
            raise UserError("model must name a model (a bundled name, directory, file or hub id)")
        if self.command not in COMMANDS:
            raise UserError(f"command must be one of {COMMANDS}, got {self.command!r}")
        for key, m in [("method", self.method), *(("compare", c) for c in self.compare)]:
            if m not in METHODS:
                raise UserError(f"--{key}: unknown method {m!r}; choose from "
                                f"{', '.join(METHODS)}")
        if self.per_token and self.method not in PER_TOKEN_METHODS:
            raise UserError(f"--per-token applies to {' and '.join(PER_TOKEN_METHODS)}, "
                            f"not {self.method}")
        if self.keep is not None and not (0 < self.keep <= 1):
            raise UserError(f"--keep must be in (0, 1], got {self.keep}")
        if self.keep is not None and self.prune is not None:
            raise UserError("give --keep or --prune, not both")
        if self.prune is not None and self.prune < 1:
            raise UserError(f"--prune must be at least 1 head, got {self.prune}")
        if self.command == "prune" and self.keep is None and self.prune is None:
            raise UserError("prune needs a target: --keep FRACTION (e.g. 0.6) or --prune N")
        if self.schedule not in SCHEDULES:
            raise UserError(f"--schedule must be iterative or one-shot, got {self.schedule!r}")
        if not 0 < self.step <= 1:
            raise UserError(f"--step must be in (0, 1], got {self.step}")
        if self.probes < 1:
            raise UserError(f"probes must be >= 1 (taylor's curvature probes), got {self.probes}")
        if self.checkpoint_every < 1:
            raise UserError(f"checkpoint_every must be >= 1 batch, got {self.checkpoint_every}")
        if self.batch_size < 1 or self.max_tokens < 1 or self.min_heads_per_layer < 0:
            raise UserError("--batch-size and --max-tokens must be >= 1, "
                            "--min-heads-per-layer >= 0")
        if self.sample_tokens < 2 or self.latency_batch < 1 or self.latency_seq_len < 1:
            raise UserError("sample_tokens must be >= 2, latency_batch and latency_seq_len >= 1")
        if self.seq_len is not None and self.seq_len < 4:
            raise UserError(f"--seq-len must be >= 4, got {self.seq_len}")
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise UserError(f"--device must be auto, cpu or cuda, got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError("--device cuda was asked for but no CUDA GPU is available; "
                            "use --device cpu (or auto)")
        if self.export not in (None, "hf"):
            raise UserError(f"--export must be 'hf', got {self.export!r}")
        if self.recover not in RECOVERY_METHODS:
            raise UserError(f"--recover must be one of {', '.join(RECOVERY_METHODS)}, "
                            f"got {self.recover!r}")
        if self.recover_params not in RECOVER_PARAMS:
            raise UserError(f"--recover-params must be one of {', '.join(RECOVER_PARAMS)}, "
                            f"got {self.recover_params!r}")
        if self.recover_tokens is not None and self.recover_tokens < 1:
            raise UserError(f"--recover-tokens must be at least 1 token, got "
                            f"{self.recover_tokens}")
        if self.recover_ridge is not None and self.recover_ridge < 0:
            raise UserError(f"--recover-ridge must be >= 0, got {self.recover_ridge}")
        if self.recover_every_step and self.recover not in TRAINING_FREE:
            raise UserError(f"--recover-every-step takes a --recover that needs no training "
                            f"({', '.join(TRAINING_FREE)}), got {self.recover!r}")
        if not self.recover_lr > 0 or not self.recover_temperature > 0:
            raise UserError("--recover-lr and --recover-temperature must be > 0, got "
                            f"{self.recover_lr} and {self.recover_temperature}")
        if not 0 < self.heldout < 1:
            raise UserError(f"heldout must be in (0, 1), got {self.heldout}")
        return self


def _check_type(name: str, declared: str, value: Any) -> None:
    """Check a value against its field's declared type ("float | None", "list[str]", ...)."""
    kinds = [k.strip() for k in declared.split("|")]
    if value is None:
        if "None" in kinds:
            return
        raise UserError(f"{name} must be set (a {kinds[0]}), got nothing")
    base = kinds[0]
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, int | float) and not isinstance(value, bool)
        and math.isfinite(value),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "list[str]": isinstance(value, list) and all(isinstance(v, str) for v in value),
    }.get(base, True)
    if not ok:
        raise UserError(f"{name} must be {'a finite ' if base == 'float' else ''}{base}, "
                        f"got {value!r}")


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> str:
    """"auto" is CUDA where a GPU is present, else the CPU; other names pass through."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


def load_recipe(path: Path, overrides: list[str]) -> dict:
    """Read a TOML recipe and apply ``key=value`` overrides (values parsed as TOML);
    the result is validated as a `RunConfig`, so unknown keys and bad values say so."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"recipe {path} does not exist; see recipes/ for examples")
    try:
        config = tomllib.loads(path.read_text("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"recipe {path} is not valid TOML: {exc}") from exc
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r} must look like key=value")
        key, value = item.split("=", 1)
        try:
            config[key.strip()] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            config[key.strip()] = value
    RunConfig.from_dict(config)
    return config
