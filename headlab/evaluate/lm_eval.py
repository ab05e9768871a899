"""lm-evaluation-harness tasks on headlab's own models.

`HeadlabLM` is lm-eval's language-model interface (`TemplateLM`, an `LM`) over a
causal-lm `HeadModel`: the same tokenisation rules as lm-eval's `HFLM` (it inherits
them), log-likelihoods from batched forwards of the pruned or unpruned model, and
generation through `headlab.models.generation.generate` (prefill once, then one position per
token over the KV cache). `run_tasks` runs named tasks through lm-eval's Python API
and returns their metrics exactly as lm-eval's ``results`` holds them.

A local task folder (``include_path``: task YAMLs over local jsonl files) runs
offline; a task that needs the Hugging Face hub says so in one line.

Shape notation: B batch, S sequence length, C continuation tokens, V vocabulary.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lm_eval.api.model import TemplateLM

from headlab.errors import UserError
from headlab.evaluate.task_code import check_task_code
from headlab.models.generation import generate
from headlab.objectives import DEFAULT_BATCH_SIZE, objective_for

if TYPE_CHECKING:
    from headlab.models.base import HeadModel

__all__ = ["HeadlabLM", "check_tasks", "lm_eval_version", "run_tasks", "task_names"]

log = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256  # as HFLM


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


class HeadlabLM(TemplateLM):
    """lm-eval's LM interface over a headlab causal language model."""

    backend = "causal"

    def __init__(self, model: HeadModel, *, batch_size: int = DEFAULT_BATCH_SIZE) -> None:
        super().__init__()
        if not objective_for(model).generates:
            raise UserError(f"lm-eval tasks need a causal language model, got a {model.kind}")
        if model.tokenizer is None:
            raise UserError("lm-eval tasks read text: the model has no tokenizer")
        self.model, self.tokenizer = model, model.tokenizer
        self.batch_size = batch_size
        self._device = model.device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is conditioned on: BOS, else EOS (as HFLM)."""
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.model.max_positions

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs) -> list[int]:
        """The tokenizer's own special-token default, none where the text already
        starts with the prefix token (HFLM's rule)."""
        options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        if add_special_tokens is None and string.startswith(
                self.tokenizer.decode(self.prefix_token_id)):
            options["add_special_tokens"] = False
        return self.tokenizer.encode(string, **options)

    @torch.no_grad()
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False,
                              **kwargs) -> list[tuple[float, bool]]:
        """(sum of the continuation's log-probabilities, whether greedy decoding gives
        it) per (strings, context ids, continuation ids); inputs longer than the model
        lose their left end, as in HFLM. Batches of similar lengths, right-padded: a
        causal model's real tokens never see the padding."""
        order = sorted(range(len(requests)),
                       key=lambda i: -(len(requests[i][1]) + len(requests[i][2])))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            inputs = [(requests[i][1] + requests[i][2])[-(self.max_length + 1):][:-1]
                      for i in rows]
            ids = torch.zeros(len(rows), max(map(len, inputs)), dtype=torch.long)  # (B, S)
            for r, inp in enumerate(inputs):
                ids[r, :len(inp)] = torch.tensor(inp)
            logits = self.model(ids.to(self.model.device)).logits  # (B, S, V)
            for r, i in enumerate(rows):
                cont = torch.tensor(requests[i][2], device=logits.device)  # (C,)
                end = len(inputs[r])
                logp = logits[r, end - len(cont):end].float().log_softmax(-1)  # (C, V)
                picked = logp.gather(-1, cont[:, None]).sum()
                results[i] = (float(picked), bool((logp.argmax(-1) == cont).all()))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in windows of the model's length, every token
        predicted once with as much context as fits (lm-eval's rolling windows)."""
        from lm_eval import utils

        windows, counts = [], []
        for (string,) in (req.args for req in requests):
            spans = utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)
            these = [(None, *utils.make_disjoint_window(s)) for s in spans]
            windows.extend(these)
            counts.append(len(these))
        scores = self._loglikelihood_tokens(windows)
        totals, at = [], 0
        for n in counts:
            totals.append(sum(s for s, _ in scores[at:at + n]))
            at += n
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Continue each context (greedy unless its kwargs sample) on the KV cache,
        stopped at EOS, then cut at the first stop string; batches share their kwargs."""
        from lm_eval.models.utils import (
            handle_stop_sequences,
            normalize_gen_kwargs,
            postprocess_generated_text,
        )

        args = [req.args for req in requests]
        key = [json.dumps(kw, sort_keys=True, default=str) for _, kw in args]
        encoded = [self.tok_encode(context) for context, _ in args]
        order = sorted(range(len(args)), key=lambda i: (key[i], -len(encoded[i])))
        results: list[str | None] = [None] * len(args)
        eos = self.tokenizer.decode(self.eot_token_id)
        start = 0
        while start < len(order):
            rows = [i for i in order[start:start + self.batch_size] if key[i] == key[order[start]]]
            start += len(rows)
            kwargs = normalize_gen_kwargs(args[rows[0]][1], DEFAULT_MAX_GEN_TOKS)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            contexts = [encoded[i][-(self.max_length - max_new):] for i in rows]
            out = self._generate(contexts, max_new, kwargs)
            for i, tokens in zip(rows, out, strict=True):
                text = self.tokenizer.decode(tokens, skip_special_tokens=True)
                results[i] = postprocess_generated_text(text, until, None)
        return results

    def _generate(self, contexts: list[list[int]], max_new: int,
                  kwargs: dict[str, Any]) -> list[list[int]]:
        """New tokens for left-padded contexts, through `headlab.models.generation.generate`."""
        width = max(map(len, contexts))
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None \
            else self.eot_token_id
        ids = torch.full((len(contexts), width), pad, dtype=torch.long)  # (B, S)
        mask = torch.zeros_like(ids)
        for r, ctx in enumerate(contexts):
            ids[r, width - len(ctx):] = torch.tensor(ctx)
            mask[r, width - len(ctx):] = 1
        sample = bool(kwargs.get("do_sample", False))
        options = {"do_sample": sample}
        if sample:
            options.update(temperature=float(kwargs.get("temperature") or 1.0),
                           top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))
        out = generate(self.model, ids.to(self.model.device), max_new_tokens=max_new,
                       attention_mask=mask.to(self.model.device),
                       eos_token_id=self.eot_token_id, pad_token_id=pad, **options)
        new = out[:, width:].tolist()
        return [row[:row.index(self.eot_token_id)] if self.eot_token_id in row else row
                for row in new]


def _task_manager(names: list[str], include_path: str | Path | None, trust_code: bool):
    """lm-eval's task index: the local folder alone where it holds every name (quick
    and offline), else lm-eval's own tasks too (indexing them takes a while, so the
    index is built once per process). A local folder whose YAMLs would run code is
    refused first, unless ``trust_code`` (`headlab.evaluate.task_code`)."""
    if include_path is not None:
        if not Path(include_path).is_dir():
            raise UserError(f"--include-path {include_path} is not a folder of task YAMLs")
        check_task_code(include_path, trust=trust_code)
    return _cached_manager(tuple(names), None if include_path is None else str(include_path))


@functools.lru_cache(maxsize=4)
def _cached_manager(names: tuple[str, ...], include_path: str | None):
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=str(include_path), include_defaults=False)
        if all(n in local.all_tasks for n in names):
            return local
    return TaskManager(include_path=include_path)


def task_names(include_path: str | Path | None = None, *,
               trust_code: bool = False) -> list[str]:
    """Every task, group and tag name lm-eval knows (with the local folder's)."""
    return _task_manager(["\0"], include_path, trust_code).all_tasks


def run_tasks(model: HeadModel, names: list[str], *, include_path: str | Path | None = None,
              limit: int | None = None, num_fewshot: int | None = None,
              batch_size: int = DEFAULT_BATCH_SIZE, seed: int = 0,
              trust_code: bool = False) -> dict[str, dict]:
    """lm-eval's metrics for each task, keyed by task name, exactly as its ``results``
    reports them (e.g. ``{"hellaswag": {"acc,none": ..., "acc_stderr,none": ...}}``).
    ``trust_code``: let the YAMLs of ``include_path`` run Python (``!function``)."""
    import lm_eval

    manager = _checked_manager(names, include_path, trust_code)
    adapter = HeadlabLM(model, batch_size=batch_size)
    try:
        out = lm_eval.simple_evaluate(
            model=adapter, tasks=list(names), task_manager=manager, limit=limit,
            num_fewshot=num_fewshot, log_samples=False, random_seed=seed,
            numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
            bootstrap_iters=1000)
    except (ConnectionError, OSError) as exc:
        raise UserError(_hub_message(names, manager, exc)) from exc
    return {name: dict(metrics) for name, metrics in out["results"].items()}


def check_tasks(names: list[str], include_path: str | Path | None = None, *,
                trust_code: bool = False) -> None:
    """Raise a one-line UserError for an unknown task name, a local task that would run
    code without ``trust_code``, or a task whose data cannot be read (offline, a hub
    dataset): before a run spends its time, not after."""
    manager = _checked_manager(names, include_path, trust_code)
    try:
        manager.load(list(names))
    except (ConnectionError, OSError) as exc:
        raise UserError(_hub_message(names, manager, exc)) from exc


def _checked_manager(names: list[str], include_path: str | Path | None, trust_code: bool):
    manager = _task_manager(names, include_path, trust_code)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise UserError(f"unknown lm-eval task(s) {', '.join(unknown)}; list the names with "
                        "`headlab eval --model M --list-tasks` (add --include-path DIR for "
                        "local tasks)")
    return manager


def _hub_message(names: list[str], manager, exc: Exception) -> str:
    """One line: which task needs the hub, and the offline way out."""
    for name in names:
        entry = manager.task_index.get(name)
        path = (entry.cfg or {}).get("dataset_path") if entry is not None else None
        if path and str(path) in str(exc):
            return (f"task {name} needs its dataset {path} from the Hugging Face hub, which "
                    "cannot be reached; run it with hub access, or give a local task folder "
                    "with --include-path")
    return (f"tasks {', '.join(names)} need data that cannot be read ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); run them with hub access, or "
            "give a local task folder with --include-path")
