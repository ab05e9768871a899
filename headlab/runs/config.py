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

from headlab._util.checks import MAX_SEED
from headlab.data.protocol import PROTOCOLS
from headlab.detectors import DECODER_KINDS
from headlab.errors import UserError
from headlab.importance import (  # noqa: F401 (DEFAULT_METHOD, UNTARGETED_METHOD: re-exported)
    DEFAULT_METHOD,
    METHODS,
    PER_TOKEN_METHODS,
    TARGETED,
    UNTARGETED_METHOD,
    check_normalize,
    default_method,
)
from headlab.importance.duo import DEFAULT_REG as GATE_REG
from headlab.importance.duo import check_reg as check_gate_reg
from headlab.importance.gates import DEFAULT_BATCH as GATE_BATCH
from headlab.importance.gates import DEFAULT_BUDGET as GATE_BUDGET
from headlab.importance.gates import DEFAULT_LR as GATE_LR
from headlab.importance.gates import DEFAULT_SAMPLE as GATE_SAMPLE
from headlab.importance.gates import DEFAULT_STEPS as GATE_STEPS
from headlab.importance.gates import check_options as check_gate_options
from headlab.objectives import DEFAULT_BATCH_SIZE
from headlab.recovery import RECOVERY_METHODS, TRAINING_FREE
from headlab.recovery.distill import LORA_SHARDED
from headlab.recovery.distill import PARAMS as RECOVER_PARAMS
from headlab.schedule import SCHEDULES, UNITS, default_schedule
from headlab.selection import GROUP_SCORES

DEVICES = ("auto", "cpu", "cuda")
SHARDING = ("fsdp",)  # headlab.parallel.sharding: the weights split across torchrun ranks

COMMANDS = ("prune", "score", "eval")
# what chooses the groups --demote demotes: a decoder's head-type detector, or
# DuoAttention's gates trained on passkey prompts (headlab.importance.duo)
DEMOTE_BY = (*DECODER_KINDS, "gates")
MAX_RIDGE = 1e6  # times mean(diag X^T X): beyond it the refit is the old weights


@dataclass
class RunConfig:
    """Everything that defines a run; recipes and CLI flags set these keys."""

    model: str
    command: str = "prune"
    method: str | None = None  # None: DEFAULT_METHOD, or UNTARGETED_METHOD without a
    # target (headlab score without --keep or --prune), as headlab.score chooses
    compare: list[str] = field(default_factory=list)  # more methods, one curve each
    keep: float | None = None
    prune: int | None = None
    schedule: str | None = None  # None: the method's (one-shot for gates and flap)
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
    # calibration / evaluation the papers' way (headlab.data.protocol); None: --data for both
    calib_data: str | None = None
    eval_data: str | None = None
    calib_samples: int | None = None  # random windows of calib_seq_len (default seq_len)
    calib_seq_len: int | None = None
    eval_protocol: str = "split"
    eval_seq_len: int | None = None  # windows protocol: None is 2048 or the model's limit
    tasks: list[str] = field(default_factory=list)  # lm-eval task names, and "needle"
    include_path: str | None = None  # a folder of local lm-eval task YAMLs
    trust_task_code: bool = False  # let include_path's YAMLs run Python (!function)
    limit: int | None = None  # lm-eval: examples per task
    num_fewshot: int | None = None
    needle_lengths: list[int] = field(default_factory=list)  # empty: 256 up to the limit
    normalize: bool | None = None  # None: the method's default (see importance.score)
    global_minmax: bool = False  # rescale all scores to [0, 1] (the ranking is unchanged)
    per_token: bool = False
    probes: int = 4  # taylor's curvature probes per batch
    gate_steps: int = GATE_STEPS  # gates: AdamW steps training the head gates
    gate_lr: float = GATE_LR  # gates: their learning rate (and the multipliers')
    gate_lagrange_lr: float | None = None  # gates: the multipliers' rate; None: gate_lr
    gate_budget: str = GATE_BUDGET  # gates: how E is held to the target (gates.BUDGETS)
    gate_batch: int = GATE_BATCH  # gates: calibration blocks per training step
    gate_sample: str = GATE_SAMPLE  # gates: one draw per block or per token (gates.SAMPLES)
    gate_reg: float = GATE_REG  # --demote-by gates: weight of the L1 penalty on the gates
    device: str = "auto"
    dtype: str = "float32"
    shard: str | None = None  # "fsdp": weights sharded across torchrun ranks (FSDP2)
    out: str | None = None
    overwrite: bool = False
    export: str | None = None
    # what repairs the pruned model; the default is measured (README, "Prune and repair")
    recover: str = "lsq"
    recover_ridge: float | None = None  # lsq, distill: None is the measured default
    recover_tokens: int | None = None  # distill: token budget; None is one pass
    recover_params: str = "out"  # distill: what trains
    recover_lr: float = 1e-4  # distill
    recover_temperature: float = 1.0  # distill
    recover_every_step: bool = False  # repair after each step too, before re-scoring
    sample_tokens: int = 64
    checkpoint_every: int = 10
    latency_batch: int = 4
    latency_seq_len: int = 128
    # the key/value cache: what a schedule counts and removes, and demotion instead
    unit: str = "head"  # or "kv-group": whole GQA groups
    group_score: str = "sum"  # a group's score from its query heads': sum or max
    kv_keep: float | None = None  # fraction of key/value heads (groups) to keep
    demote: bool = False  # heads pruning would remove keep a sink + window cache
    sinks: int = 4
    window: int = 256
    demote_by: str | None = None  # DEMOTE_BY: what chooses the demoted groups; None: method
    decode_steps: int = 8  # timed decoding steps per context (kv-group and demote runs)

    def __post_init__(self) -> None:
        if self.method is None:  # prune always has a target (validated)
            self.method = default_method(self.command != "score" or self.keep is not None
                                         or self.prune is not None)

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

    def schedule_of(self, method: str) -> str:
        """The schedule ``method`` runs in this run: ``schedule`` where given, else
        `headlab.schedule.default_schedule` of the method."""
        return self.schedule or default_schedule(method)

    def validated(self) -> RunConfig:
        """Check types and ranges; raise UserError naming the key."""
        for f in fields(self):
            _check_type(f.name, str(f.type), getattr(self, f.name))
        if not self.model:
            raise UserError("model must name a model (a bundled name, directory, file or hub id)")
        if self.out is not None and not self.out.strip():
            raise UserError("--out '' names no directory (it would write into the current "
                            "one); give a directory path, or leave --out out")
        if self.command not in COMMANDS:
            raise UserError(f"command must be one of {COMMANDS}, got {self.command!r}")
        for key, m in [("method", self.method), *(("compare", c) for c in self.compare)]:
            if m not in METHODS:
                raise UserError(f"--{key}: unknown method {m!r}; choose from "
                                f"{', '.join(METHODS)}")
        if self.per_token and self.method not in PER_TOKEN_METHODS:
            raise UserError(f"--per-token applies to {' and '.join(PER_TOKEN_METHODS)}, "
                            f"not {self.method}")
        check_normalize(self.method, self.normalize)
        if self.keep is not None and not (0 < self.keep <= 1):
            raise UserError(f"--keep must be in (0, 1], got {self.keep}")
        if self.keep is not None and self.prune is not None:
            raise UserError("give --keep or --prune, not both")
        if self.prune is not None and self.prune < 1:
            raise UserError(f"--prune must be at least 1 head, got {self.prune}")
        if (self.command == "prune" and self.keep is None and self.prune is None
                and self.kv_keep is None):
            raise UserError("prune needs a target: --keep FRACTION (e.g. 0.6), --prune N "
                            "or --kv-keep FRACTION with --unit kv-group")
        targeted = self.keep is not None or self.prune is not None
        if self.command == "score" and targeted and self.method not in TARGETED:
            raise UserError(f"--keep/--prune on score set the target of "
                            f"{', '.join(TARGETED)}; {self.method} scores without one")
        if self.command == "score" and self.method in TARGETED and not targeted:
            raise UserError(f"--method {self.method} trains toward a number of heads to "
                            "keep: give --keep FRACTION or --prune N")
        check_gate_options(self.gate_steps, self.gate_lr, self.gate_lagrange_lr,
                           self.gate_budget, self.gate_batch, self.gate_sample)
        check_gate_reg(self.gate_reg)
        self._check_kv_cache()
        if self.schedule is not None and self.schedule not in SCHEDULES:
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
        if self.shard is not None and self.shard not in SHARDING:
            raise UserError(f"--shard must be {' or '.join(SHARDING)}, got {self.shard!r}")
        if self.shard is not None and self.command == "prune":
            given = [flag for flag, on in (("--recover-every-step", self.recover_every_step),
                                           ("--export", self.export is not None)) if on]
            if given:
                raise UserError(f"a sharded prune repairs once, after pruning, and does not "
                                f"export: drop {', '.join(given)} (export model/ unsharded, "
                                "where it fits)")
            if self.recover == "distill" and self.recover_params == "lora":
                raise UserError(LORA_SHARDED)
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
        if self.recover_ridge is not None and not 0 <= self.recover_ridge <= MAX_RIDGE:
            raise UserError(f"--recover-ridge must be in [0, {MAX_RIDGE:g}] (times the "
                            f"mean of diag X^T X), got {self.recover_ridge}")
        if self.recover_ridge is not None and self.recover not in ("lsq", "distill"):
            raise UserError(f"--recover-ridge applies to lsq (and distill's lsq start), "
                            f"not --recover {self.recover}: drop it")
        if not 0 <= self.seed <= MAX_SEED:
            raise UserError(f"--seed must be in [0, 2**63 - 1], got {self.seed}")
        if self.recover != "distill":
            given = [flag for flag, on in (
                ("--recover-tokens", self.recover_tokens is not None),
                ("--recover-params", self.recover_params != "out")) if on]
            if given:
                raise UserError(f"{' and '.join(given)} shape distill, which --recover "
                                f"{self.recover} does not run: drop them or use --recover "
                                "distill")
        if self.recover_every_step and self.recover not in TRAINING_FREE:
            raise UserError(f"--recover-every-step takes a --recover that needs no training "
                            f"({', '.join(TRAINING_FREE)}), got {self.recover!r}")
        if not 0 < self.recover_lr <= 1 or not self.recover_temperature > 0:
            raise UserError("--recover-lr must be in (0, 1] and --recover-temperature > 0, "
                            f"got {self.recover_lr} and {self.recover_temperature}")
        if not 0 < self.heldout < 1:
            raise UserError(f"heldout must be in (0, 1), got {self.heldout}")
        self._validate_protocol()
        return self

    def _check_kv_cache(self) -> None:
        """The key/value-cache options: unit, group score, kv_keep, demotion."""
        if self.unit not in UNITS:
            raise UserError(f"--unit must be one of {', '.join(UNITS)}, got {self.unit!r}")
        if self.group_score not in GROUP_SCORES:
            raise UserError(f"--group-score must be one of {', '.join(GROUP_SCORES)}, "
                            f"got {self.group_score!r}")
        if self.kv_keep is not None:
            if not 0 < self.kv_keep <= 1:
                raise UserError(f"--kv-keep must be in (0, 1] (a fraction of the key/value "
                                f"heads), got {self.kv_keep}")
            if self.unit != "kv-group":
                raise UserError("--kv-keep counts key/value heads: add --unit kv-group")
            if self.keep is not None or self.prune is not None:
                raise UserError("give --kv-keep or --keep/--prune, not both")
        if self.unit == "kv-group" and self.prune is not None:
            raise UserError("--unit kv-group removes whole groups: give --kv-keep FRACTION "
                            "(or --keep, the fraction of query heads), not --prune")
        if self.unit == "kv-group" and self.min_heads_per_layer:
            raise UserError("--min-heads-per-layer counts query heads; with --unit kv-group "
                            "use --per-layer to keep groups in every layer")
        if self.sinks < 0:
            raise UserError(f"--sinks must be >= 0, got {self.sinks}")
        if self.window < 1:
            raise UserError(f"--window must be >= 1 position (the streaming heads' recent "
                            f"keys, the query's own included), got {self.window}")
        if self.demote and self.unit != "kv-group":
            raise UserError("--demote works on whole GQA groups (a key/value head serves "
                            "its group): add --unit kv-group (on a model without GQA a "
                            "group is one head)")
        if self.demote_by is not None and not self.demote:
            raise UserError("--demote-by chooses the groups --demote demotes: add --demote "
                            "(or drop --demote-by)")
        if self.demote_by is not None and self.demote_by not in DEMOTE_BY:
            raise UserError(f"--demote-by: unknown detector {self.demote_by!r}; choose from "
                            f"{', '.join(DEMOTE_BY)} (demotion works on decoders)")
        if self.decode_steps < 1:
            raise UserError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.demote and self.export == "hf":
            raise UserError("--demote keeps heads with a sink + window cache, which plain "
                            "transformers cannot express: drop --export hf (the model is "
                            "saved in headlab format), or prune without --demote")

    def _validate_protocol(self) -> None:
        """The calibration / evaluation keys (headlab.data.protocol) and the task keys."""
        if self.eval_protocol not in PROTOCOLS:
            raise UserError(f"--eval-protocol must be one of {', '.join(PROTOCOLS)}, got "
                            f"{self.eval_protocol!r}")
        if self.calib_samples is not None and self.calib_samples < 1:
            raise UserError(f"--calib-samples must be at least 1, got {self.calib_samples}")
        for key in ("calib_seq_len", "eval_seq_len"):
            value = getattr(self, key)
            if value is not None and value < 4:
                raise UserError(f"--{key.replace('_', '-')} must be >= 4, got {value}")
        if self.calib_seq_len is not None and self.calib_samples is None:
            raise UserError("--calib-seq-len is the length of --calib-samples windows: "
                            "give --calib-samples N too")
        if self.eval_seq_len is not None and self.eval_protocol != "windows":
            raise UserError("--eval-seq-len is the window of --eval-protocol windows: "
                            "give --eval-protocol windows too")
        if self.limit is not None and self.limit < 1:
            raise UserError(f"--limit must be at least 1 example, got {self.limit}")
        if not all(isinstance(n, int) and n >= 64 for n in self.needle_lengths):
            raise UserError(f"--needle-lengths must be token counts >= 64, got "
                            f"{self.needle_lengths}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise UserError(f"--num-fewshot must be >= 0, got {self.num_fewshot}")


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
        "list[int]": isinstance(value, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value),
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
    except UnicodeDecodeError as exc:
        raise UserError(f"recipe {path} is not UTF-8 text (byte {exc.start}); a recipe is "
                        "TOML text") from None
    except RecursionError:
        raise UserError(f"recipe {path} nests deeper than TOML readers go") from None
    if config.get("trust_task_code"):
        raise UserError(f"recipe {path} sets trust_task_code: a recipe cannot trust its own "
                        "task code; pass --trust-task-code to `headlab run` to allow it")
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
