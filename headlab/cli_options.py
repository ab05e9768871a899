"""The `headlab` command's choices, defaults and shared options.

Choices and defaults come from `headlab.config`, where a run's keys are defined once;
each option a command shares is declared here once, with its help text.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from headlab.config import (
    DEVICES,
    DTYPES,
    METHODS,
    RECOVER_PARAMS,
    RECOVERY_METHODS,
    SCHEDULES,
    SHARDING,
    RunConfig,
)

Method = StrEnum("Method", [(m, m) for m in METHODS])
Schedule = StrEnum("Schedule", [(m, m) for m in SCHEDULES])
Device = StrEnum("Device", [(m, m) for m in DEVICES])
DType = StrEnum("DType", [(m, m) for m in DTYPES])
Recovery = StrEnum("Recovery", [(m, m) for m in RECOVERY_METHODS])
RecoverParams = StrEnum("RecoverParams", [(m, m) for m in RECOVER_PARAMS])
Sharding = StrEnum("Sharding", [(m, m) for m in SHARDING])
D = RunConfig.defaults()
DEFAULT_METHOD, DEFAULT_SCHEDULE = Method(D["method"]), Schedule(D["schedule"])
DEFAULT_DEVICE, DEFAULT_DTYPE = Device(D["device"]), DType(D["dtype"])
DEFAULT_RECOVERY, DEFAULT_RECOVER_PARAMS = Recovery(D["recover"]), RecoverParams(
    D["recover_params"])


ModelOpt = Annotated[str, typer.Option("--model", "-m", help="Bundled name (smollm2-135m, "
                                       "minilm-l6), local directory, .gguf file or hub id.")]
RunModelOpt = Annotated[str | None, typer.Option(
    "--model", "-m", help="Bundled name (smollm2-135m, minilm-l6), local directory, .gguf "
    "file or hub id (not needed with --resume).")]
ResumeOpt = Annotated[Path | None, typer.Option(
    help="Continue an interrupted run directory with its own configuration.")]
DataOpt = Annotated[str | None, typer.Option(
    help="Dataset (name:config:split), .txt/.jsonl/.csv/.tsv file; default: bundled text.")]
MethodOpt = Annotated[Method, typer.Option(help="Importance method.")]
OutOpt = Annotated[Path | None, typer.Option(
    help="Run directory (default reports/<model>-<method>-keep<k>-<time>/).")]
TextColumnOpt = Annotated[str | None, typer.Option(help="Text column of the data.")]
LabelColumnOpt = Annotated[str | None, typer.Option(help="Label column (classifiers).")]
MaxTokensOpt = Annotated[int, typer.Option(help="Token budget for scoring + held-out.")]
SeqLenOpt = Annotated[int | None, typer.Option(
    help="Block length (default: the objective's, 256 for language models, 128 else, "
         "capped by the model's positions).")]
BatchSizeOpt = Annotated[int, typer.Option(help="Blocks per batch.")]
SeedOpt = Annotated[int, typer.Option(
    help="Seed of the scoring/held-out split, the masking and random scores.")]
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
    help="Divide each layer's scores by their l2 norm (Michel et al.); default: on, but off "
         "for taylor, ablation and random.")]
MinmaxOpt = Annotated[bool, typer.Option(
    help="Rescale all scores to [0, 1] (as the bertology script did).")]
PerTokenOpt = Annotated[bool, typer.Option(help="One gate per token (michel/fisher).")]
ProbesOpt = Annotated[int, typer.Option(help="Curvature probes per batch (taylor).")]
