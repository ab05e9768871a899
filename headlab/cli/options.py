"""The `headlab` command's choices, defaults and options.

Choices and defaults come from `headlab.runs.config`, where a run's keys are defined once;
each option is declared here once, with its help text and default, in the groups the run
commands (`prune`, `score`, `eval`) compose with `takes`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from headlab.importance.gates import BUDGETS as GATE_BUDGETS
from headlab.importance.gates import SAMPLES as GATE_SAMPLES
from headlab.models.loading import BUNDLED
from headlab.runs.config import (
    DEFAULT_METHOD,
    DEMOTE_BY,
    DEVICES,
    DTYPES,
    METHODS,
    PROTOCOLS,
    RECOVER_PARAMS,
    RECOVERY_METHODS,
    SCHEDULES,
    SHARDING,
    UNTARGETED_METHOD,
    RunConfig,
)
from headlab.schedule import UNITS
from headlab.selection import GROUP_SCORES

Method = StrEnum("Method", [(m, m) for m in METHODS])
Schedule = StrEnum("Schedule", [(m, m) for m in SCHEDULES])
Device = StrEnum("Device", [(m, m) for m in DEVICES])
DType = StrEnum("DType", [(m, m) for m in DTYPES])
Recovery = StrEnum("Recovery", [(m, m) for m in RECOVERY_METHODS])
RecoverParams = StrEnum("RecoverParams", [(m, m) for m in RECOVER_PARAMS])
Sharding = StrEnum("Sharding", [(m, m) for m in SHARDING])
GateBudget = StrEnum("GateBudget", [(m, m) for m in GATE_BUDGETS])
GateSample = StrEnum("GateSample", [(m, m) for m in GATE_SAMPLES])
D = RunConfig.defaults()
DEFAULT_DEVICE, DEFAULT_DTYPE = Device(D["device"]), DType(D["dtype"])
DEFAULT_RECOVERY, DEFAULT_RECOVER_PARAMS = Recovery(D["recover"]), RecoverParams(
    D["recover_params"])


BUNDLED_HELP = f"Bundled name ({', '.join(BUNDLED)})"
ModelOpt = Annotated[str, typer.Option("--model", "-m", help=BUNDLED_HELP + ", local "
                                       "directory, .gguf file or hub id.")]
RunModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help=BUNDLED_HELP + ", local directory, .gguf file or hub id (not "
    "needed with --resume).")]
ResumeOpt = Annotated[Path | None, typer.Option(
    help="Continue an interrupted run directory with its own configuration.")]
DataOpt = Annotated[str | None, typer.Option(
    help="enwiki (Wikipedia articles, offline, split by article), a dataset "
         "name:config:split, or a .txt/.jsonl/.csv/.tsv file; default: bundled text.")]
MethodOpt = Annotated[Method | None, typer.Option(
    help=f"Importance method [default: {DEFAULT_METHOD}; {UNTARGETED_METHOD} on score "
         "without --keep or --prune]", show_default=False)]
OutOpt = Annotated[str | None, typer.Option(
    help="Run directory (default reports/<model>-<method>-<target>-<time>/, the target "
         "keep<k>, prune<n> or score).")]
TextColumnOpt = Annotated[str | None, typer.Option(help="Text column of the data.")]
LabelColumnOpt = Annotated[str | None, typer.Option(help="Label column (classifiers).")]
MaxTokensOpt = Annotated[int, typer.Option(help="Token budget for scoring + held-out.")]
SeqLenOpt = Annotated[int | None, typer.Option(
    help="Block length (default: the objective's, 256 for language models, 128 else, "
         "capped by the model's positions).")]
BatchSizeOpt = Annotated[int, typer.Option(help="Blocks per batch.")]
SeedOpt = Annotated[int, typer.Option(
    help="Seed of what a run draws at random: the scoring/held-out split, random "
         "scores, taylor's curvature probes and the gates' noise.")]
DeviceOpt = Annotated[Device, typer.Option(help="auto picks CUDA when present.")]
DTypeOpt = Annotated[DType, typer.Option(help="Model dtype.")]
ShardOpt = Annotated[Sharding | None, typer.Option(
    help="fsdp: split the weights across torchrun ranks (FSDP2, one unit per block); every "
         "rank then sees every batch.")]
OverwriteOpt = Annotated[bool, typer.Option(help="Replace an existing run directory.")]
QuietOpt = Annotated[bool, typer.Option("--quiet", "-q", help="No progress or logs.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print a JSON summary.")]
NormalizeOpt = Annotated[bool | None, typer.Option(
    "--normalize/--no-normalize", show_default=False,
    help="Divide each layer's scores by their l2 norm (Michel et al.); default: on for "
         "michel, fisher, entropy and confidence, off for the others; not for random.")]
MinmaxOpt = Annotated[bool, typer.Option(
    help="Rescale all scores to [0, 1] (as the bertology script did).")]
PerTokenOpt = Annotated[bool, typer.Option(help="One gate per token (michel/fisher).")]
ProbesOpt = Annotated[int, typer.Option(help="Curvature probes per batch (taylor).")]
GateStepsOpt = Annotated[int, typer.Option(
    help="gates: steps training the head gates (--gate-batch blocks each; one passkey "
         "prompt each for --demote-by gates).")]
GateBatchOpt = Annotated[int, typer.Option(
    help="gates: calibration blocks per training step (each step is one update: fewer "
         "blocks per step, more updates for the same tokens).")]
GateLrOpt = Annotated[float, typer.Option(
    help="gates: learning rate of the gates and, unless --gate-lagrange-lr, of the "
         "Lagrangian's multipliers (and of --demote-by gates).")]
GateLagrangeLrOpt = Annotated[float | None, typer.Option(
    show_default=False,
    help="gates: learning rate of the Lagrangian's multipliers alone; default: --gate-lr. "
         "The run warns where the gates end far from their target.")]
GateBudgetOpt = Annotated[GateBudget, typer.Option(
    help="gates: how the expected number of open gates is held to the target: "
         "'lagrangian' (CoFi's multipliers, AdamW steps) or 'projection' (normalised "
         "gradient steps, all gates shifted onto the target after each).")]
GateSampleOpt = Annotated[GateSample, typer.Option(
    help="gates: what one draw of the gates covers: 'block' (every position of a block "
         "sees the same heads) or 'token' (a draw per token and head).")]
GateRegOpt = Annotated[float, typer.Option(
    help="--demote-by gates: weight of the L1 penalty that pulls the gates toward "
         "streaming (DuoAttention's 0.05).")]

Unit = StrEnum("Unit", [(m, m) for m in UNITS])
GroupScore = StrEnum("GroupScore", [(m, m) for m in GROUP_SCORES])
DEFAULT_UNIT, DEFAULT_GROUP_SCORE = Unit(D["unit"]), GroupScore(D["group_score"])
UnitOpt = Annotated[Unit, typer.Option(
    help="What is scored and removed: query heads, or whole GQA groups (a key/value head "
         "and its query heads), so every removal shrinks the key/value cache.")]
GroupScoreOpt = Annotated[GroupScore, typer.Option(
    help="kv-group: a group's score is the sum (or max) of its query heads' scores.")]
KvKeepOpt = Annotated[float | None, typer.Option(
    help="Fraction of key/value heads (groups) to keep, in (0, 1]; needs --unit kv-group.")]
DemoteOpt = Annotated[bool, typer.Option(
    help="Demote instead of remove: the heads pruning would remove (whole GQA groups) "
         "attend only to the first --sinks and the last --window positions and keep only "
         "those in their key/value cache.")]
SinksOpt = Annotated[int, typer.Option(help="--demote: attention-sink positions kept.")]
WindowOpt = Annotated[int, typer.Option(help="--demote: recent positions kept (>= 1).")]
DemoteBy = StrEnum("DemoteBy", [(k, k) for k in DEMOTE_BY])
DemoteByOpt = Annotated[DemoteBy | None, typer.Option(
    help="--demote: choose the demoted groups by a head-type detector instead of --method: "
         "the groups scoring highest (--group-score of their query heads) keep their full "
         "cache, the rest are demoted; retrieval finds DuoAttention's retrieval heads; "
         "gates trains DuoAttention's gates (--gate-steps, --gate-lr, --gate-reg) on "
         "passkey prompts and demotes the groups whose gates end lowest.")]
# calibration / evaluation the papers' way (headlab.data.protocol), lm-eval tasks
# (headlab.evaluate.lm_eval)
Protocol = StrEnum("Protocol", [(m, m) for m in PROTOCOLS])
DEFAULT_PROTOCOL = Protocol(D["eval_protocol"])
CalibDataOpt = Annotated[str | None, typer.Option(
    help="What scores and what recovery fits on (anything --data takes); default --data.")]
ScoreCalibDataOpt = Annotated[str | None, typer.Option(
    help="What the heads are scored on (anything --data takes); default --data.")]
EvalDataOpt = Annotated[str | None, typer.Option(
    help="Held-out quality data (anything --data takes); default --data. One source for "
         "both is split by documents, none in both.")]
CalibSamplesOpt = Annotated[int | None, typer.Option(
    help="Calibrate on N seeded random windows (the papers use 128 of 2048 tokens).")]
CalibSeqLenOpt = Annotated[int | None, typer.Option(
    help="Tokens per --calib-samples window (default --seq-len).")]
EvalProtocolOpt = Annotated[Protocol, typer.Option(
    help="split: blocks of --seq-len; windows: the text joined with blank lines, "
         "non-overlapping windows of --eval-seq-len, exp of the mean token loss.")]
EvalSeqLenOpt = Annotated[int | None, typer.Option(
    help="Window of --eval-protocol windows (default 2048, or the model's limit).")]
TasksOpt = Annotated[str | None, typer.Option(
    help="Comma-separated lm-evaluation-harness tasks, and 'needle'; `headlab eval "
         "--list-tasks` lists the names.")]
IncludePathOpt = Annotated[Path | None, typer.Option(
    help="A folder of local lm-eval task YAMLs (runs offline on local jsonl).")]
TrustTaskCodeOpt = Annotated[bool, typer.Option(
    help="Let --include-path's task YAMLs run their Python (lm-eval's !function, class:, "
         "dataset scripts); without it such a YAML is refused, nothing imported.")]
LimitOpt = Annotated[int | None, typer.Option(help="lm-eval: at most N examples per task.")]
NumFewshotOpt = Annotated[int | None, typer.Option(help="lm-eval: few-shot examples.")]
NeedleLengthsOpt = Annotated[str | None, typer.Option(
    help="Needle test context lengths in tokens, e.g. 256,512,1024 (default 256 doubling "
         "up to the model's limit).")]


# ---------------------------------------------------------------- one declaration each
@dataclass(frozen=True)
class Opt:
    """One option: its parameter name, its type with the `typer.Option` (flag, help
    text), and its default."""

    name: str
    annotation: Any
    default: Any = None


def takes(*groups: Opt | tuple[Opt, ...]) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Give a command ``def cmd(**values)`` the options of ``groups``, in that order:
    typer reads the parameters from the signature set here and calls it by name."""
    flat = [o for g in groups for o in (g if isinstance(g, tuple) else (g,))]
    signature = inspect.Signature([
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, annotation=o.annotation,
                          default=inspect.Parameter.empty if o.default is ... else o.default)
        for o in flat])

    def decorate(fn: Callable[..., None]) -> Callable[..., None]:
        @functools.wraps(fn)
        def command(**values: Any) -> None:
            fn(**values)

        command.__signature__ = signature  # type: ignore[attr-defined]
        command.__annotations__ = {o.name: o.annotation for o in flat}
        del command.__wrapped__  # typer reads __signature__, not fn's
        return command

    return decorate


_NOT_KEYS = ("quiet", "json_mode", "resume")  # how to print and where to resume: no run keys


def run_keys(command: str, values: dict[str, Any]) -> dict[str, Any]:
    """The RunConfig keys of a command's option values: choices by value, paths as text,
    --prune as ``prune``, --compare as a list, the task options parsed."""
    from headlab.cli.common import task_keys

    keys = {"prune" if k == "prune_n" else k: _plain(v) for k, v in values.items()
            if k not in _NOT_KEYS}
    if "compare" in keys:
        keys["compare"] = keys["compare"] or []
    keys.update(task_keys(*(values[k] for k in ("tasks", "include_path", "limit",
                                                "num_fewshot", "needle_lengths"))))
    return {"command": command, **keys}


def _plain(value: Any) -> Any:
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


MODEL = Opt("model", RunModelOpt)
TARGET = (
    Opt("keep", Annotated[float | None, typer.Option(
        help="Fraction of heads to keep, in (0, 1].")]),
    Opt("prune_n", Annotated[int | None, typer.Option("--prune",
                                                      help="Number of heads to remove.")]))
METHOD = Opt("method", MethodOpt, None)
SCHEDULE = (
    Opt("schedule", Annotated[Schedule | None, typer.Option(
        help="Re-score after each step (iterative), or score once (one-shot); by default "
             "one-shot for gates and flap, which choose jointly, iterative for the rest.")],
        None),
    Opt("step", Annotated[float, typer.Option(help="Fraction of the heads removed per step.")],
        D["step"]),
    Opt("per_layer", Annotated[bool, typer.Option(
        help="Keep the same number in every layer.")], False),
    Opt("min_heads_per_layer", Annotated[int, typer.Option(
        help="Protect each layer's best heads.")], D["min_heads_per_layer"]))
DATA = (
    Opt("data", DataOpt), Opt("text_column", TextColumnOpt),
    Opt("label_column", LabelColumnOpt), Opt("max_tokens", MaxTokensOpt, D["max_tokens"]),
    Opt("seq_len", SeqLenOpt), Opt("batch_size", BatchSizeOpt, D["batch_size"]),
    Opt("seed", SeedOpt, D["seed"]))
DEVICE = (Opt("device", DeviceOpt, DEFAULT_DEVICE), Opt("dtype", DTypeOpt, DEFAULT_DTYPE),
          Opt("shard", ShardOpt))
RUN_DIR = (Opt("out", OutOpt), Opt("overwrite", OverwriteOpt, False))
EXPORT = (
    Opt("export", Annotated[str | None, typer.Option(
        help="'hf': also write a directory plain transformers loads, where expressible.")]),
    Opt("compare", Annotated[list[Method] | None, typer.Option(
        metavar="<method>",
        help="Another --method to draw a curve for (repeat the option).")]))
SCORING = (Opt("normalize", NormalizeOpt), Opt("global_minmax", MinmaxOpt, False),
           Opt("per_token", PerTokenOpt, False), Opt("probes", ProbesOpt, D["probes"]),
           Opt("gate_steps", GateStepsOpt, D["gate_steps"]),
           Opt("gate_lr", GateLrOpt, D["gate_lr"]),
           Opt("gate_lagrange_lr", GateLagrangeLrOpt),
           Opt("gate_budget", GateBudgetOpt, D["gate_budget"]),
           Opt("gate_batch", GateBatchOpt, D["gate_batch"]),
           Opt("gate_sample", GateSampleOpt, D["gate_sample"]))
RECOVERY = (
    Opt("recover", Annotated[Recovery, typer.Option(
        help="Repair after pruning, on the scoring split: lsq refits each layer's output "
             "and MLP down projections, bias folds the removed heads' mean in, rescale "
             "scales each kept head and neuron (Kwon et al.), distill trains toward the "
             "unpruned model (after lsq); none compares with Michel et al.")], DEFAULT_RECOVERY),
    Opt("recover_ridge", Annotated[float | None, typer.Option(
        help="lsq: ridge toward the current weights, times mean(diag X^T X).")]),
    Opt("recover_tokens", Annotated[int | None, typer.Option(
        help="distill: token budget (default one pass over the scoring split).")]),
    Opt("recover_params", Annotated[RecoverParams, typer.Option(
        help="distill: what trains (lora needs peft).")], DEFAULT_RECOVER_PARAMS),
    Opt("recover_lr", Annotated[float, typer.Option(help="distill: AdamW learning rate.")],
        D["recover_lr"]),
    Opt("recover_temperature", Annotated[float, typer.Option(
        help="distill: KL temperature.")], D["recover_temperature"]))
KV_CACHE = (
    Opt("unit", UnitOpt, DEFAULT_UNIT), Opt("group_score", GroupScoreOpt, DEFAULT_GROUP_SCORE),
    Opt("kv_keep", KvKeepOpt), Opt("demote", DemoteOpt, False),
    Opt("sinks", SinksOpt, D["sinks"]), Opt("window", WindowOpt, D["window"]),
    Opt("demote_by", DemoteByOpt), Opt("gate_reg", GateRegOpt, D["gate_reg"]))
PROTOCOL = (
    Opt("calib_data", CalibDataOpt), Opt("eval_data", EvalDataOpt),
    Opt("calib_samples", CalibSamplesOpt), Opt("calib_seq_len", CalibSeqLenOpt),
    Opt("eval_protocol", EvalProtocolOpt, DEFAULT_PROTOCOL),
    Opt("eval_seq_len", EvalSeqLenOpt))
SCORE_PROTOCOL = (Opt("calib_data", ScoreCalibDataOpt), *PROTOCOL[1:])
TASKS = (Opt("tasks", TasksOpt), Opt("include_path", IncludePathOpt),
         Opt("trust_task_code", TrustTaskCodeOpt, False),
         Opt("limit", LimitOpt), Opt("num_fewshot", NumFewshotOpt))
NEEDLE_LENGTHS = Opt("needle_lengths", NeedleLengthsOpt)
RECOVER_EVERY_STEP = Opt("recover_every_step", Annotated[bool, typer.Option(
    help="Repair after each step too (bias, lsq, rescale), before re-scoring; the "
         "curve shows the repaired quality.")], False)
PRINT = (Opt("quiet", QuietOpt, False), Opt("json_mode", JsonOpt, False))
RESUME = Opt("resume", ResumeOpt)
