"""Head-type detectors: what a head does, as a score in [0, 1] per (layer, original head).

    previous-token   mean attention from position i to i-1, on the bundled text
    next-token       mean attention from i to i+1 (encoders), on the bundled text
    duplicate-token  on random token sequences repeated twice (drawn without
                     replacement from the vocabulary, special tokens excluded, seeded),
                     mean attention from each position of the second repeat to the
                     earlier occurrence of the same token
    induction        on the same sequences, mean attention from each position of the
                     second repeat to the token after its earlier occurrence
                     (Olsson et al. 2022; TransformerLens' head_detector)
    sink             mean attention mass on the first position and on every BOS/[CLS]
                     token, on the bundled text
    cls, sep, punctuation
                     (encoders) mean mass on [CLS], on [SEP] and on punctuation tokens
                     (Clark et al. 2019's roles, `headlab.analysis.roles`)
    retrieval        (decoders) on needle-in-a-haystack prompts built offline (a key-value
                     fact at a seeded depth in the bundled text, then the question and the
                     answer, teacher-forced): the fraction of answer steps at which the
                     model predicts the needle token it copies and the head's strongest
                     attention lands on that token inside the needle (Wu et al. 2024's
                     retrieval score)
Every mean runs over the scored query rows: valid positions past the first (the first
attends only to itself under a causal mask), and for the repeated sequences only the
second repeat. The pattern hook reduces over keys at once, so no (B, H, S, T) tensor
outlives its layer's forward and a detector runs at a forward's memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from headlab._util.checks import check_int, check_seed
from headlab.analysis.roles import TokenRoles
from headlab.attention.hooks import hooks, layer_of
from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.importance import HeadScores
from headlab.models.base import HeadModel
from headlab.objectives import objective_for

__all__ = ["DECODER_KINDS", "ENCODER_KINDS", "KINDS", "Probe", "detect", "detect_all", "kinds_for",
           "probes", "top_heads"]

DECODER_KINDS = ("previous-token", "induction", "duplicate-token", "sink", "retrieval")
ENCODER_KINDS = ("previous-token", "next-token", "induction", "duplicate-token", "sink",
                 "cls", "sep", "punctuation")
KINDS = tuple(dict.fromkeys(DECODER_KINDS + ENCODER_KINDS))


@dataclass(eq=False)
class Probe:
    """One batch a detector reads: inputs, which key each scored query row looks for.

    ``target`` (B, S, T) weights each key of a row (1 = the place the head type attends
    to); ``rows`` (B, S) marks the scored query rows. ``argmax``: a row scores
    ``target`` at the head's strongest key instead of the mass on the targets, and
    ``answer`` (B, S) holds the token the row must predict (-1: none required).
    """

    input_ids: torch.Tensor  # (B, S)
    attention_mask: torch.Tensor  # (B, S)
    target: torch.Tensor  # (B, S, T) float
    rows: torch.Tensor  # (B, S) bool
    argmax: bool = False
    answer: torch.Tensor | None = None  # (B, S) long


def kinds_for(model: HeadModel) -> tuple[str, ...]:
    """The detectors that apply to ``model``: retrieval needs a decoder, [CLS]/[SEP]
    and the next token need an encoder."""
    return DECODER_KINDS if model.causal else ENCODER_KINDS


@torch.no_grad()
def detect(model: HeadModel, kind: str, *, n: int = 16, seq_len: int = 128,
           repeat_len: int = 40, batch_size: int = 8, seed: int = 0,
           batches: Iterable[Probe] | None = None) -> HeadScores:
    """Score every present head of ``model`` as a ``kind`` head (see the module docstring).

    ``n`` examples: blocks of ``seq_len`` tokens of the bundled text, random sequences of
    ``repeat_len`` tokens repeated twice, or needle prompts of about ``seq_len`` tokens;
    ``seed`` draws the random tokens and the needles. ``batches`` replaces the built
    inputs (`probes` builds them). Pruned heads are NaN.
    """
    if kind not in kinds_for(model):
        raise UserError(f"detector {kind!r} does not apply to a {model.kind} model; "
                        f"choose from {', '.join(kinds_for(model))}")
    n, seq_len, repeat_len, batch_size = (
        check_int(v, name, low=1) for v, name in ((n, "n"), (seq_len, "seq_len"),
                                                  (repeat_len, "repeat_len"),
                                                  (batch_size, "batch_size")))
    seed = check_seed(seed)
    if batches is None:
        batches = probes(model, kind, n=n, seq_len=seq_len, repeat_len=repeat_len,
                         batch_size=batch_size, seed=seed)
    sums = [torch.zeros(a.n_heads, dtype=torch.float64) for a in model.attentions]
    rows_total = 0.0
    was_training = model.training
    model.eval()
    try:
        for probe in batches:
            device = model.device
            target = probe.target.to(device)
            per_row: dict[int, torch.Tensor] = {}

            def reduce(pattern: torch.Tensor, name: str, _target=target, _probe=probe,
                       _rows=per_row):
                _rows[layer_of(name)] = _row_values(pattern, _target, _probe.argmax)
                return None

            with hooks(model, {"pattern": reduce}):
                out = model(probe.input_ids.to(device),
                            attention_mask=probe.attention_mask.to(device))
            weight = probe.rows.to(device).double()  # (B, S)
            if probe.answer is not None:
                predicted = out.logits.argmax(-1)  # (B, S)
                answer = probe.answer.to(device)
                weight = weight * ((answer < 0) | (predicted == answer)).double()
            for layer, values in per_row.items():
                sums[layer] += torch.einsum("bhs,bs->h", values, weight).cpu()
            rows_total += float(probe.rows.sum())
    finally:
        model.train(was_training)
    if not rows_total:
        raise UserError(f"detector {kind!r}: no query row to score; give longer inputs")
    scores = torch.full((model.n_layers, model.n_original_heads), math.nan, dtype=torch.float64)
    for layer, a in enumerate(model.attentions):
        active = (a.head_gate != 0).cpu()
        for p, h in enumerate(a.head_ids.tolist()):
            if active[p]:
                scores[layer, h] = sums[layer][p] / rows_total
    return HeadScores(scores.tolist(), kind, _DATA[kind], int(rows_total), None,
                      {"seed": seed, "n": n, "seq_len": seq_len, "repeat_len": repeat_len})


def _row_values(pattern: torch.Tensor, target: torch.Tensor, argmax: bool) -> torch.Tensor:
    """Per head and query row: the mass on the targets, or the target weight at the
    strongest key. pattern (B, H, S, T), target (B, S, T) -> (B, H, S) float64."""
    if argmax:
        strongest = pattern.argmax(-1)  # (B, H, S)
        B, H, S = strongest.shape
        t = target[:, None].expand(B, H, S, target.shape[-1])
        return t.gather(-1, strongest[..., None]).squeeze(-1).double()
    return torch.einsum("bhst,bst->bhs", pattern.double(), target.double())


_DATA = {
    "previous-token": "bundled text", "next-token": "bundled text", "sink": "bundled text",
    "cls": "bundled text", "sep": "bundled text", "punctuation": "bundled text",
    "induction": "random tokens repeated twice", "duplicate-token": "random tokens repeated twice",
    "retrieval": "needle prompts in the bundled text",
}


def probes(model: HeadModel, kind: str, *, n: int = 16, seq_len: int = 128,
           repeat_len: int = 40, batch_size: int = 8, seed: int = 0) -> list[Probe]:
    """The batches `detect` reads for ``kind``, built from the model's tokenizer."""
    tok = model.tokenizer
    if tok is None:
        raise UserError("detectors build their inputs with the model's tokenizer, and this "
                        "model has none; pass batches=")
    if kind in ("induction", "duplicate-token"):
        ids, mask, start = _repeated_tokens(model, n=n, length=repeat_len, seed=seed)
        chunks = _split(ids, mask, batch_size)
        return [_repeat_probe(i, m, start, repeat_len, kind) for i, m in chunks]
    if kind == "retrieval":
        return _needle_probes(tok, n=n, seq_len=seq_len, batch_size=batch_size, seed=seed)
    blocks = objective_for(model).make_blocks(load_texts(), tok, seq_len=seq_len,
                                              max_tokens=n * seq_len)
    ids, mask = blocks.input_ids[:n], blocks.attention_mask[:n]
    return [_text_probe(tok, i, m, kind) for i, m in _split(ids, mask, batch_size)]


def _split(ids, mask, batch_size):
    return [(ids[s:s + batch_size], mask[s:s + batch_size]) for s in range(0, len(ids), batch_size)]


def _text_probe(tok, ids: torch.Tensor, mask: torch.Tensor, kind: str) -> Probe:
    """Targets on natural text: a fixed offset, or the keys of one token role."""
    B, S = ids.shape
    valid = mask.bool()
    rows = valid.clone()
    first = valid.long().argmax(1)  # (B,) the first valid position
    rows[torch.arange(B), first] = False
    pair = valid[:, :, None] & valid[:, None, :]  # (B, S, T)
    if kind in ("previous-token", "next-token"):
        offset = -1 if kind == "previous-token" else 1
        target = torch.diag_embed(torch.ones(B, S - 1), offset=offset).float() * pair
        return Probe(ids, mask, target, rows)
    tokens = [tok.convert_ids_to_tokens(row.tolist()) for row in ids]
    roles = TokenRoles.from_tokens(tokens, cls_token=tok.cls_token, sep_token=tok.sep_token,
                                   valid=valid)
    if kind == "sink":
        starts = {t for t in (tok.bos_token_id, tok.cls_token_id) if t is not None}
        keys = roles.first | (torch.isin(ids, torch.tensor(sorted(starts))) & valid
                              if starts else roles.first)
    else:
        keys = {"cls": roles.cls, "sep": roles.sep, "punctuation": roles.punct}[kind]
    target = (keys[:, None, :] & pair).float()
    return Probe(ids, mask, target, rows)


def _repeated_tokens(model: HeadModel, *, n: int, length: int, seed: int):
    """``n`` rows of [prefix] r r [suffix]: r ``length`` distinct random non-special
    tokens; the prefix is BOS or [CLS] where the tokenizer has one, the suffix [SEP]
    for encoders. Returns ids (n, S), mask (n, S) and where the first repeat starts."""
    tok = model.tokenizer
    special = set(tok.all_special_ids)
    vocab = min(len(tok), _vocab_size(model))
    allowed = torch.tensor([t for t in range(vocab) if t not in special])
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        r = allowed[torch.randperm(len(allowed), generator=gen)[:length]]
        rows.append(torch.cat([r, r]))
    ids = torch.stack(rows)
    prefix = tok.bos_token_id if model.causal else tok.cls_token_id
    start = 0
    if prefix is not None:
        ids = torch.cat([torch.full((n, 1), prefix), ids], 1)
        start = 1
    if not model.causal and tok.sep_token_id is not None:
        ids = torch.cat([ids, torch.full((n, 1), tok.sep_token_id)], 1)
    return ids, torch.ones_like(ids), start


def _vocab_size(model: HeadModel) -> int:
    """The word embedding's rows: the largest embedding table of the model."""
    return max(m.num_embeddings for m in model.modules() if isinstance(m, torch.nn.Embedding))


def _repeat_probe(ids, mask, start: int, length: int, kind: str) -> Probe:
    """Rows of the second repeat look back ``length`` tokens (duplicate) or
    ``length - 1`` (induction: the token after the earlier occurrence)."""
    B, S = ids.shape
    back = length if kind == "duplicate-token" else length - 1
    rows = torch.zeros(B, S, dtype=torch.bool)
    rows[:, start + length:start + 2 * length] = True
    target = torch.zeros(B, S, S)
    q = torch.arange(start + length, start + 2 * length)
    target[:, q, q - back] = 1.0
    return Probe(ids, mask, target, rows)


def top_heads(scores: HeadScores, k: int = 5) -> list[tuple[int, int, float]]:
    """The ``k`` highest-scoring (layer, head, score), best first; NaN never ranks."""
    flat = [(layer, head, v) for layer, row in enumerate(scores.scores)
            for head, v in enumerate(row) if not math.isnan(v)]
    return sorted(flat, key=lambda x: -x[2])[:k]


def detect_all(model: HeadModel, kinds: Sequence[str] | None = None, **kwargs
               ) -> dict[str, HeadScores]:
    """`detect` for each of ``kinds`` (default: every kind that applies), by kind."""
    return {k: detect(model, k, **kwargs) for k in (kinds or kinds_for(model))}


# invented names: a needle's key never occurs in the filler text
_NAMES = ("Varrok", "Tessilun", "Omberga", "Quillane", "Drovent", "Paskiri", "Elmoquay",
          "Zunthar", "Brevalo", "Icterra", "Morvish", "Caldrune", "Yssendor", "Lupakai")


def _needle_probes(tok, *, n: int, seq_len: int, batch_size: int, seed: int) -> list[Probe]:
    """``n`` prompts of about ``seq_len`` tokens: filler from the bundled text with
    " The secret number of NAME is DIGITS." at a seeded depth, then the question and
    the answer, teacher-forced. A row predicting an answer token targets the needle
    positions that hold that token."""
    gen = torch.Generator().manual_seed(seed)
    stream = tok(" ".join(load_texts().texts), add_special_tokens=False)["input_ids"]
    prompts = []
    for _ in range(n):
        name = _NAMES[int(torch.randint(len(_NAMES), (1,), generator=gen))]
        digits = "".join(str(int(d)) for d in torch.randint(10, (6,), generator=gen))
        def enc(text):
            return tok(text, add_special_tokens=False)["input_ids"]
        key, value, dot = enc(f" The secret number of {name} is"), enc(f" {digits}"), enc(".")
        question = enc(f"\nQuestion: what is the secret number of {name}?\nAnswer: The "
                       f"secret number of {name} is")
        fill = max(seq_len - len(key) - 2 * len(value) - len(dot) - len(question), 8)
        at = int(torch.randint(len(stream) - fill, (1,), generator=gen))
        filler = stream[at:at + fill]
        depth = int(torch.randint(fill + 1, (1,), generator=gen))
        before = filler[:depth] + key
        ids = before + value + dot + filler[depth:] + question + value
        prompts.append((ids, len(before), len(ids) - len(value), value))
    width = max(len(ids) for ids, *_ in prompts)
    pad = tok.eos_token_id if tok.eos_token_id is not None else 0
    out = []
    for s in range(0, n, batch_size):
        chunk = prompts[s:s + batch_size]
        B = len(chunk)
        ids = torch.full((B, width), pad, dtype=torch.long)
        mask = torch.zeros(B, width, dtype=torch.long)
        target = torch.zeros(B, width, width)
        answer = torch.full((B, width), -1, dtype=torch.long)
        for b, (row, needle, start, value) in enumerate(chunk):
            ids[b, :len(row)] = torch.tensor(row)
            mask[b, :len(row)] = 1
            for j, token in enumerate(value):
                q = start + j - 1  # the row that predicts answer token j
                answer[b, q] = token
                for i, other in enumerate(value):
                    if other == token:
                        target[b, q, needle + i] = 1.0
        out.append(Probe(ids, mask, target, answer >= 0, argmax=True, answer=answer))
    return out
