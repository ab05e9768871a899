"""What a run reads before its stages: the model, and its token blocks split into
scoring and held-out data (the bundled text, a dataset, or the papers' calibration and
evaluation sets of `headlab.data.protocol`)."""

from __future__ import annotations

import logging

from headlab.data import protocol
from headlab.data.blocks import Blocks, split_blocks
from headlab.data.texts import CORPORA, TextData, load_texts
from headlab.errors import UserError
from headlab.models.base import HeadModel
from headlab.models.loading import load
from headlab.objectives import objective_for
from headlab.parallel.sharding import load_sharded
from headlab.runs.config import DTYPES, RunConfig, resolve_device

log = logging.getLogger("headlab")



def load_model(cfg: RunConfig) -> HeadModel:
    device, dtype = resolve_device(cfg.device), DTYPES[cfg.dtype]
    if cfg.shard == "fsdp":  # the memory guard assumes the objective's longest blocks;
        # a prune holds the pruned model beside this one
        return load_sharded(cfg.model, device=device, dtype=dtype, batch_size=cfg.batch_size,
                            seq_len=cfg.seq_len or 256, backward=cfg.command != "eval",
                            models=2 if cfg.command == "prune" else 1)[0]
    return load(cfg.model, device=device, dtype=dtype)


def build_data(cfg: RunConfig, model: HeadModel) -> tuple[Blocks, Blocks, int]:
    """Token blocks split into (scoring, held-out), prepared on the unpruned model by
    its objective; and the block length used."""
    if model.tokenizer is None:
        raise UserError(f"{cfg.model} has no tokenizer files; headlab needs one to read text")
    objective = objective_for(model)
    limit = model.max_positions
    seq_len = cfg.seq_len or min(objective.default_seq_len, limit)
    if seq_len > limit:
        log.warning("--seq-len %d exceeds the model's %d positions; truncating to %d",
                    seq_len, limit, limit)
        seq_len = limit
    if papers_protocol(cfg):
        scoring, heldout = _protocol_sets(cfg, model, seq_len)
    else:
        texts = load_texts(cfg.data, text_column=cfg.text_column, label_column=cfg.label_column)
        if texts.warning:
            log.warning(texts.warning)
        blocks = objective.make_blocks(texts, model.tokenizer, seq_len=seq_len,
                                       max_tokens=cfg.max_tokens)
        scoring, heldout = split_blocks(blocks, heldout=cfg.heldout, seed=cfg.seed)
    scoring = objective.prepare(model, scoring, batch_size=cfg.batch_size, seed=cfg.seed)
    heldout = objective.prepare(model, heldout, batch_size=cfg.batch_size, seed=cfg.seed + 1)
    return scoring, heldout, seq_len


def papers_protocol(cfg: RunConfig) -> bool:
    """True where the run names its calibration or evaluation data apart, or asks for
    random calibration windows or the windows protocol (`headlab.data.protocol`)."""
    return (cfg.calib_data is not None or cfg.eval_data is not None
            or cfg.calib_samples is not None or cfg.eval_protocol != "split"
            or cfg.data in CORPORA)


def _protocol_sets(cfg: RunConfig, model: HeadModel, seq_len: int) -> tuple[Blocks, Blocks]:
    """(calibration, evaluation) blocks from --calib-data / --eval-data (default --data);
    one source for both is split by documents, so no text is in both."""
    calib_spec, eval_spec = cfg.calib_data or cfg.data, cfg.eval_data or cfg.data
    limit = model.max_positions
    if cfg.calib_seq_len is not None and cfg.calib_seq_len > limit:
        raise UserError(f"--calib-seq-len {cfg.calib_seq_len} is above the model's limit of "
                        f"{limit} positions; give at most {limit}")
    settings = protocol.Settings(
        kind=model.kind, seq_len=seq_len, max_tokens=cfg.max_tokens, heldout=cfg.heldout,
        seed=cfg.seed, calib_samples=cfg.calib_samples, calib_seq_len=cfg.calib_seq_len,
        eval_protocol=cfg.eval_protocol,
        eval_seq_len=protocol.eval_seq_len_for(cfg.eval_seq_len, limit))
    read = {"text_column": cfg.text_column, "label_column": cfg.label_column}
    calibration = load_texts(calib_spec, **read)
    evaluation = None if eval_spec == calib_spec else load_texts(eval_spec, **read)
    for texts in (calibration, evaluation):
        if texts is not None and texts.warning:
            log.warning(texts.warning)
    return build_sets(settings, model.tokenizer, calibration, evaluation)


def data_separation(cfg: RunConfig) -> str:
    """How the run keeps its scoring and held-out data apart, for results.json."""
    if not papers_protocol(cfg):
        return (f"one source cut into blocks, the blocks split by seed {cfg.seed}: a fraction "
                f"{cfg.heldout:g} held out; no block in both")
    spec = cfg.calib_data or cfg.data
    same = spec == (cfg.eval_data or cfg.data)
    return protocol.describe(same_source=same, heldout=cfg.heldout, seed=cfg.seed,
                             documents=load_texts(spec) if same and spec in CORPORA
                             else None)


def check_protocol(settings: protocol.Settings) -> None:
    """Refuse the windows where the kind of model reads text otherwise
    (`headlab.objectives.Objective.reads_windows`)."""
    windows = settings.calib_samples is not None or settings.eval_protocol == "windows"
    if windows and not objective_for(settings.kind).reads_windows:
        raise UserError("--calib-samples and --eval-protocol windows are the causal "
                        f"language models' protocol; this model is a {settings.kind}")


def build_sets(settings: protocol.Settings, tokenizer, calibration: TextData,
               evaluation: TextData | None) -> tuple[Blocks, Blocks]:
    """(calibration, evaluation) blocks; ``evaluation`` None: the same source as
    ``calibration``, whose documents are split (`protocol.split_documents`) so no text
    is in both.

    The split protocol cuts each set as the model's kind reads text
    (`headlab.objectives.make_blocks`), within ``max_tokens``, except a corpus of
    documents (enwiki) that a causal LM reads: `protocol.document_windows` of ``seq_len``
    spread over its documents. ``windows`` measures on `protocol.evaluation_windows` of
    ``eval_seq_len`` (at most ``max_tokens`` of them), and ``calib_samples`` scores on
    `protocol.calibration_windows`.
    """
    s = settings
    check_protocol(s)
    objective = objective_for(s.kind)
    if evaluation is None:
        calibration, evaluation = protocol.split_documents(calibration, heldout=s.heldout,
                                                           seed=s.seed)
    if s.calib_samples is not None:
        calib = protocol.calibration_windows(calibration, tokenizer, n_samples=s.calib_samples,
                                    seq_len=s.calib_seq_len or s.seq_len, seed=s.seed)
    elif _corpus(calibration, objective):
        calib = protocol.document_windows(calibration, tokenizer, seq_len=s.seq_len,
                                          max_tokens=s.max_tokens, seed=s.seed,
                                          what="calibration")
    else:
        calib = objective.make_blocks(calibration, tokenizer, seq_len=s.seq_len,
                                      max_tokens=s.max_tokens)
    if s.eval_protocol == "windows":
        held = protocol.evaluation_windows(evaluation, tokenizer, seq_len=s.eval_seq_len,
                                  max_windows=max(1, s.max_tokens // s.eval_seq_len))
    elif _corpus(evaluation, objective):
        held = protocol.document_windows(evaluation, tokenizer, seq_len=s.seq_len,
                                         max_tokens=s.max_tokens, seed=s.seed + 1,
                                         what="evaluation")
    else:
        held = objective.make_blocks(evaluation, tokenizer, seq_len=s.seq_len,
                                     max_tokens=s.max_tokens)
    return calib, held


def _corpus(texts: TextData, objective) -> bool:
    """Whether ``texts`` are a corpus of documents that ``objective`` reads in windows."""
    return texts.documents and objective.reads_windows
