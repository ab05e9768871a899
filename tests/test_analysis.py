"""Tests for headlab.analysis: per-head statistics, token roles, rollout, clustering.

Known answers come from hand-built heads (previous-token, uniform, self, first-token sink,
[SEP]); random patterns are checked against plain Python reference loops in float64.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from headlab.analysis import (
    STAT_NAMES,
    HeadClusters,
    HeadStats,
    HeadStatsAccumulator,
    TokenRoles,
    attention_entropy,
    cluster_heads,
    head_statistics,
    pattern_features,
    rollout,
)

# float64 sums of a few hundred terms: anything beyond rounding is a bug.
EXACT = {"rtol": 1e-12, "atol": 1e-12}


# ---------------------------------------------------------------------------------------
# helpers


def _one_hot(targets: list[int], length: int) -> torch.Tensor:
    """(S, T) pattern whose row q puts all its weight on key targets[q]."""
    pattern = torch.zeros(len(targets), length, dtype=torch.float64)
    pattern[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return pattern


def _values(stats: HeadStats, name: str) -> torch.Tensor:
    """One statistic for every head, in record order, as a float64 tensor."""
    return torch.tensor([r[name] for r in stats.records], dtype=torch.float64)


def _random_patterns(
    gen: torch.Generator,
    valid: torch.Tensor,
    n_heads: int,
    *,
    causal: bool = False,
    garbage: bool = True,
) -> torch.Tensor:
    """Row-stochastic (B, H, S, S) over valid (and causal) keys; invalid rows hold junk."""
    n_batch, length = valid.shape
    scores = torch.randn(n_batch, n_heads, length, length, generator=gen, dtype=torch.float64)
    allowed = valid[:, None, :, None] & valid[:, None, None, :]  # (B, 1, S, S)
    if causal:
        allowed = allowed & torch.ones(length, length, dtype=torch.bool).tril()
    pattern = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
    if garbage:  # what a model may leave in padded query rows: must not matter
        junk = torch.rand(pattern.shape, generator=gen, dtype=torch.float64)
        pattern = torch.where(valid[:, None, :, None], pattern, junk)
    return pattern


def _random_roles(gen: torch.Generator, n_batch: int, length: int) -> TokenRoles:
    """Left-padded rows (at least 2 real tokens) with random [CLS]/[SEP]/punctuation."""
    pad = torch.randint(0, length - 1, (n_batch,), generator=gen)
    valid = torch.arange(length)[None, :] >= pad[:, None]  # (B, S)

    def some() -> torch.Tensor:
        return torch.rand(n_batch, length, generator=gen) < 0.3

    return TokenRoles(
        valid=valid, first=torch.arange(length)[None, :] == pad[:, None],
        cls=some(), sep=some(), punct=some(),
    )


def _reference_stats(patterns: list[torch.Tensor], roles: TokenRoles) -> list[dict]:
    """Per-head statistics by plain loops over examples, heads and valid query rows."""
    records = []
    for layer, pattern in enumerate(patterns):
        for h in range(pattern.shape[1]):
            sums, n_rows = dict.fromkeys(STAT_NAMES, 0.0), 0
            for b in range(pattern.shape[0]):
                keys = [t for t in range(pattern.shape[-1]) if roles.valid[b, t]]
                for q in keys:
                    w = {t: float(pattern[b, h, q, t]) for t in keys}
                    if sum(w.values()) <= 0:
                        continue
                    n_rows += 1
                    sums["entropy"] += -sum(x * math.log(x) for x in w.values() if x > 0)
                    for role in ("first", "cls", "sep", "punct"):
                        sums[role] += sum(w[t] for t in keys if getattr(roles, role)[b, t])
                    sums["self"] += w[q]
                    sums["prev"] += w.get(q - 1, 0.0)
                    sums["next"] += w.get(q + 1, 0.0)
                    sums["confidence"] += max(w.values())
            means = {k: v / n_rows for k, v in sums.items()}
            records.append({"layer": layer, "head": h, **means})
    return records


def _as_matrix(records: list[dict]) -> torch.Tensor:
    return torch.tensor([[r[k] for k in STAT_NAMES] for r in records], dtype=torch.float64)


# ---------------------------------------------------------------------------------------
# hand-built heads with known answers


def test_previous_token_head() -> None:
    length = 6
    pattern = _one_hot([0, 0, 1, 2, 3, 4], length)[None, None]  # (1, 1, S, S)
    roles = TokenRoles.from_mask(torch.ones(1, length, dtype=torch.bool))
    (record,) = head_statistics([pattern], roles).records
    got = torch.tensor([record[k] for k in STAT_NAMES], dtype=torch.float64)
    # Row 0 has no previous token and attends to itself: prev = (S-1)/S, self = 1/S.
    want = {"entropy": 0.0, "first": 2 / 6, "cls": 0.0, "sep": 0.0, "punct": 0.0,
            "self": 1 / 6, "prev": 5 / 6, "next": 0.0, "confidence": 1.0}
    assert_close(got, torch.tensor([want[k] for k in STAT_NAMES], dtype=torch.float64), **EXACT)
    assert (record["layer"], record["head"]) == (0, 0)


def test_uniform_head_with_left_padding() -> None:
    valid = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]], dtype=torch.bool)
    n_valid = valid.sum(-1).to(torch.float64)  # (B,) = 5, 3
    uniform = valid[:, None, None, :] / n_valid[:, None, None, None]  # (B, 1, S, S)
    pattern = torch.where(valid[:, None, :, None], uniform, torch.full_like(uniform, 0.7))

    entropy = attention_entropy(pattern, valid)  # (B, 1, S)
    assert_close(entropy[0, 0], torch.full((5,), math.log(5), dtype=torch.float64), **EXACT)
    assert_close(entropy[1, 0, 2:], torch.full((3,), math.log(3), dtype=torch.float64), **EXACT)

    (record,) = head_statistics([pattern], TokenRoles.from_mask(valid)).records
    got = [record[k] for k in ("entropy", "confidence", "self", "first")]
    # 8 valid rows: 5 of log 5 and 3 of log 3; each row gives 1/n to itself and to first.
    assert_close(got, [(5 * math.log(5) + 3 * math.log(3)) / 8, 2 / 8, 2 / 8, 2 / 8], **EXACT)
    assert_close(record["prev"], (4 * 1 / 5 + 2 * 1 / 3) / 8, **EXACT)


def test_causal_uniform_entropy_is_log_of_visible_keys() -> None:
    length = 7
    causal = torch.ones(length, length, dtype=torch.float64).tril()
    pattern = (causal / causal.sum(-1, keepdim=True))[None, None]  # (1, 1, S, S)
    entropy = attention_entropy(pattern)[0, 0]  # (S,)
    want = torch.log(torch.arange(1, length + 1, dtype=torch.float64))
    assert_close(entropy, want, **EXACT)
    (record,) = head_statistics([pattern], TokenRoles.from_mask(torch.ones(1, length))).records
    assert_close(record["entropy"], float(want.mean()), **EXACT)
    assert_close(record["confidence"], sum(1 / n for n in range(1, length + 1)) / length, **EXACT)


def test_self_head() -> None:
    length = 4
    pattern = torch.eye(length, dtype=torch.float64).expand(2, 3, length, length)
    stats = head_statistics([pattern], TokenRoles.from_mask(torch.ones(2, length)))
    for name, want in [("self", 1.0), ("prev", 0.0), ("next", 0.0), ("entropy", 0.0),
                       ("confidence", 1.0), ("first", 1 / length)]:
        assert_close(_values(stats, name), torch.full((3,), want, dtype=torch.float64), **EXACT)


def test_first_token_sink_is_left_padding_aware() -> None:
    tokens = [["The", "Ġcat", "Ġsat", "."],
              ["<|endoftext|>", "<|endoftext|>", "Hi", "!"]]
    valid = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    roles = TokenRoles.from_tokens(tokens, valid=valid)
    sink = torch.stack([_one_hot([0, 0, 0, 0], 4), _one_hot([0, 0, 2, 2], 4)])[:, None]
    (record,) = head_statistics([sink], roles).records
    got = [record[k] for k in ("first", "entropy", "self", "prev", "next")]
    # 6 valid rows; the two first tokens attend to themselves, the two seconds back to them.
    assert_close(got, [1.0, 0.0, 2 / 6, 2 / 6, 0.0], **EXACT)


def test_sep_head_on_bert_tokens() -> None:
    tokens = [["[CLS]", "the", "cat", "sat", ".", "[SEP]"]]
    roles = TokenRoles.from_tokens(tokens, cls_token="[CLS]", sep_token="[SEP]")
    to_sep = _one_hot([5] * 6, 6)
    uniform = torch.full((6, 6), 1 / 6, dtype=torch.float64)
    pattern = torch.stack([to_sep, uniform])[None]  # (1, 2, S, S)
    stats = head_statistics([pattern], roles)
    sep_head, uniform_head = stats.records
    assert_close([sep_head[k] for k in ("sep", "cls", "first", "punct", "self", "next")],
                 [1.0, 0.0, 0.0, 0.0, 1 / 6, 1 / 6], **EXACT)
    assert_close([uniform_head[k] for k in ("sep", "cls", "first", "punct", "entropy")],
                 [1 / 6, 1 / 6, 1 / 6, 1 / 6, math.log(6)], **EXACT)


# ---------------------------------------------------------------------------------------
# padding, masking, streaming


def test_random_patterns_match_reference_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    roles = _random_roles(gen, 3, 7)
    patterns = [_random_patterns(gen, roles.valid, 3, causal=True),
                _random_patterns(gen, roles.valid, 2)]
    stats = head_statistics(patterns, roles)
    assert_close(_as_matrix(stats.records), _as_matrix(_reference_stats(patterns, roles)),
                 **EXACT)


def test_padding_is_ignored() -> None:
    gen = torch.Generator().manual_seed(1)
    short = _random_patterns(gen, torch.ones(1, 3, dtype=torch.bool), 2)  # (1, 2, 3, 3)
    full = _random_patterns(gen, torch.ones(1, 5, dtype=torch.bool), 2)  # (1, 2, 5, 5)
    # The short example left-padded to 5; padded query rows hold junk.
    padded = torch.rand(1, 2, 5, 5, generator=gen, dtype=torch.float64)
    padded[..., 2:, :2] = 0.0
    padded[..., 2:, 2:] = short
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    batch = head_statistics([torch.cat([padded, full])], TokenRoles.from_mask(valid))

    separate = HeadStatsAccumulator(1)
    separate.update([short], TokenRoles.from_mask(torch.ones(1, 3)))
    separate.update([full], TokenRoles.from_mask(torch.ones(1, 5)))
    assert_close(_as_matrix(batch.records), _as_matrix(separate.result().records), **EXACT)


def test_weight_on_masked_keys_is_dropped() -> None:
    valid = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    pattern = torch.zeros(1, 1, 4, 4, dtype=torch.float64)
    pattern[..., :3, 0] = 0.5
    pattern[..., :3, 3] = 0.5  # weight on the padded key: zeroed, not renormalised
    (record,) = head_statistics([pattern], TokenRoles.from_mask(valid)).records
    assert_close([record["first"], record["entropy"], record["confidence"]],
                 [0.5, 0.5 * math.log(2), 0.5], **EXACT)


def test_fully_masked_rows_are_skipped_without_nan() -> None:
    pattern = torch.eye(3, dtype=torch.float64).repeat(1, 2, 1, 1)  # (1, 2, S, S)
    pattern[0, 0, 1] = 0.0  # head 0: one row with no weight left
    pattern[0, 1] = 0.0  # head 1: nothing at all
    stats = head_statistics([pattern], TokenRoles.from_mask(torch.ones(1, 3)))
    kept, empty = stats.records
    assert_close([kept[k] for k in STAT_NAMES],
                 [0.0, 0.5, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 1.0], **EXACT)
    assert all(math.isnan(empty[k]) for k in STAT_NAMES)
    # JSON has no NaN: a head without data is written as null and read back as NaN.
    text = json.dumps(stats.to_json(), allow_nan=False)
    again = HeadStats.from_json(text)
    assert math.isnan(again.records[1]["entropy"])
    assert again.records[0] == kept


def test_streaming_equals_one_shot_on_concatenation() -> None:
    gen = torch.Generator().manual_seed(2)
    head_ids = [[0, 3, 5], [1, 2]]
    batches = []
    for n_batch, length in [(2, 5), (3, 7), (1, 6)]:
        roles = _random_roles(gen, n_batch, length)
        patterns = [_random_patterns(gen, roles.valid, 3, causal=True),
                    _random_patterns(gen, roles.valid, 2)]
        batches.append((patterns, roles))

    accumulator = HeadStatsAccumulator(2)
    for patterns, roles in batches:
        accumulator.update(patterns, roles, head_ids=head_ids)
    streamed = accumulator.result()

    # One batch: each example right-padded to the longest length with invalid positions.
    longest = max(roles.shape[1] for _, roles in batches)

    def pad(x: torch.Tensor, dims: int) -> torch.Tensor:
        extra = longest - x.shape[-1]
        return torch.nn.functional.pad(x, (0, extra) * dims)

    joined_roles = TokenRoles(*(
        torch.cat([pad(getattr(roles, name), 1) for _, roles in batches])
        for name in ("valid", "first", "cls", "sep", "punct")
    ))
    joined = [torch.cat([pad(patterns[layer], 2) for patterns, _ in batches])
              for layer in range(2)]
    one_shot = head_statistics(joined, joined_roles, head_ids=head_ids)

    assert [(r["layer"], r["head"]) for r in streamed.records] == [
        (0, 0), (0, 3), (0, 5), (1, 1), (1, 2)]
    assert_close(_as_matrix(streamed.records), _as_matrix(one_shot.records), **EXACT)
    assert_close(_as_matrix(one_shot.records),
                 _as_matrix(_reference_stats(joined, joined_roles)), **EXACT)


def test_float32_and_stacked_input() -> None:
    gen = torch.Generator().manual_seed(3)
    roles = _random_roles(gen, 2, 6)
    stacked = torch.stack([_random_patterns(gen, roles.valid, 4) for _ in range(2)])
    as_list = head_statistics(list(stacked), roles)
    assert_close(_as_matrix(head_statistics(stacked, roles).records), _as_matrix(as_list.records),
                 **EXACT)
    low = head_statistics(stacked.float(), roles)
    assert_close(_as_matrix(low.records), _as_matrix(as_list.records), rtol=1e-5, atol=1e-6)


def test_input_errors_say_what_to_do() -> None:
    roles = TokenRoles.from_mask(torch.ones(1, 4))
    square = torch.full((1, 2, 4, 4), 0.25)
    with pytest.raises(ValueError, match="one tensor of shape"):
        head_statistics(square, roles)
    with pytest.raises(ValueError, match="S == T"):
        head_statistics([torch.full((1, 2, 4, 5), 0.2)], roles)
    with pytest.raises(ValueError, match="roles are"):
        head_statistics([square], TokenRoles.from_mask(torch.ones(1, 3)))
    with pytest.raises(ValueError, match="head_ids\\[0\\] names 3 heads"):
        head_statistics([square], roles, head_ids=[[0, 1, 2]])
    accumulator = HeadStatsAccumulator(1)
    with pytest.raises(ValueError, match="no data"):
        accumulator.result()
    accumulator.update([square], roles, head_ids=[[0, 1]])
    with pytest.raises(ValueError, match="heads must not change"):
        accumulator.update([square], roles, head_ids=[[0, 2]])
    with pytest.raises(ValueError, match="2 layers"):
        accumulator.update([square, square], roles)


# ---------------------------------------------------------------------------------------
# HeadStats views


def test_head_stats_views_round_trip() -> None:
    gen = torch.Generator().manual_seed(4)
    roles = _random_roles(gen, 2, 5)
    stats = head_statistics([_random_patterns(gen, roles.valid, 2)], roles, head_ids=[[4, 7]])
    records = stats.to_records()
    records[0]["entropy"] = -1.0  # a copy: the stats stay as they were
    assert stats.records[0]["entropy"] != -1.0
    assert list(stats.records[0]) == ["layer", "head", *STAT_NAMES]

    again = HeadStats.from_json(json.dumps(stats.to_json()))
    assert again.records == stats.records

    frame = stats.to_dataframe()
    assert list(frame.columns) == ["layer", "head", *STAT_NAMES]
    assert frame["head"].tolist() == [4, 7]
    assert_close(frame["prev"].tolist(), [r["prev"] for r in stats.records], **EXACT)

    page = stats._repr_html_()
    assert page.startswith("<table") and page.count("<tr>") == 3
    assert f"{stats.records[1]['entropy']:.3f}" in page
    assert "<script" not in page and "http" not in page


# ---------------------------------------------------------------------------------------
# token roles


def test_token_roles_gpt2_style() -> None:
    tokens = [["Hello", "Ġworld", ",", "Ġhow", "?", "Ġ...", "Ċ", "Ġ(", "Ġ$", "Ġ3", "Ġ'"]]
    roles = TokenRoles.from_tokens(tokens)
    assert roles.punct[0].tolist() == [False, False, True, False, True, True, False, True,
                                       True, False, True]
    assert roles.first[0].tolist() == [True] + [False] * 10
    assert not roles.cls.any() and not roles.sep.any() and roles.valid.all()


def test_token_roles_bert_and_sentencepiece_style() -> None:
    tokens = [["[CLS]", "un", "##believ", "##able", "!", "[SEP]", "yes", "##,", "[SEP]", "[PAD]"],
              ["▁Hello", "▁,", "▁world", "▁."]]
    roles = TokenRoles.from_tokens(tokens, cls_token="[CLS]", sep_token=["[SEP]"],
                                   valid=[[1] * 9 + [0], [1] * 4 + [0] * 6])
    assert roles.shape == (2, 10)
    assert roles.valid.sum(-1).tolist() == [9, 4]
    assert roles.cls.nonzero().tolist() == [[0, 0]]
    assert roles.sep.nonzero().tolist() == [[0, 5], [0, 8]]
    assert roles.punct.nonzero().tolist() == [[0, 4], [0, 7], [1, 1], [1, 3]]
    assert roles.first.nonzero().tolist() == [[0, 0], [1, 0]]


def test_token_roles_ragged_and_left_padded() -> None:
    ragged = TokenRoles.from_tokens([["a", "b", "."], ["c"]])
    assert ragged.valid.tolist() == [[True, True, True], [True, False, False]]
    assert ragged.punct.tolist() == [[False, False, True], [False, False, False]]

    left = TokenRoles.from_tokens([["[PAD]", "[PAD]", "[CLS]", "x"]], cls_token="[CLS]",
                                  valid=torch.tensor([[0, 0, 1, 1]]))
    assert left.first.tolist() == [[False, False, True, False]]
    assert left.cls.tolist() == [[False, False, True, False]]
    empty = TokenRoles.from_mask(torch.zeros(1, 3))
    assert not empty.first.any()


def test_token_roles_validation() -> None:
    with pytest.raises(TypeError, match="list of token lists"):
        TokenRoles.from_tokens(["Hello", "Ġworld"])
    with pytest.raises(ValueError, match="valid has shape"):
        TokenRoles.from_tokens([["a", "b"]], valid=[[1, 1, 1]])
    with pytest.raises(ValueError, match="TokenRoles.sep has shape"):
        TokenRoles(valid=torch.ones(1, 3), first=torch.zeros(1, 3), cls=torch.zeros(1, 3),
                   sep=torch.zeros(1, 4), punct=torch.zeros(1, 3))
    # Roles on padding are cleared: padding never counts as anything.
    roles = TokenRoles(valid=[[1, 0]], first=[[1, 1]], cls=[[0, 1]], sep=[[0, 1]],
                       punct=[[0, 1]])
    assert roles.cls.tolist() == roles.sep.tolist() == roles.punct.tolist() == [[False, False]]


# ---------------------------------------------------------------------------------------
# rollout


def _reference_rollout(patterns: list[torch.Tensor], fusion: str, residual: bool) -> np.ndarray:
    """Rollout by plain numpy loops over examples and layers, in float64."""
    arrays = [p.double().numpy() for p in patterns]
    n_batch, length = arrays[0].shape[0], arrays[0].shape[-1]
    fuse = {"mean": np.mean, "max": np.max, "min": np.min}[fusion]
    out = np.zeros((n_batch, length, length))
    for b in range(n_batch):
        flow = np.eye(length)
        for layer in arrays:
            a = fuse(layer[b], axis=0)
            if residual:
                a = 0.5 * a + 0.5 * np.eye(length)
            a = a / a.sum(axis=-1, keepdims=True)
            flow = a @ flow
        out[b] = flow
    return out


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_of_identity_is_identity(fusion: str, residual: bool) -> None:
    eye = torch.eye(5).expand(2, 3, 5, 5)
    got = rollout([eye, eye, eye], add_residual=residual, head_fusion=fusion)
    assert_close(got, torch.eye(5).expand(2, 5, 5), rtol=0, atol=1e-7)


def test_rollout_single_layer_without_residual_is_head_mean() -> None:
    gen = torch.Generator().manual_seed(5)
    pattern = _random_patterns(gen, torch.ones(2, 6, dtype=torch.bool), 4, causal=True)
    assert_close(rollout([pattern], add_residual=False), pattern.mean(dim=1), **EXACT)


@pytest.mark.parametrize("fusion", ["mean", "max", "min"])
@pytest.mark.parametrize("residual", [True, False])
def test_rollout_matches_reference_loop(fusion: str, residual: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    valid = torch.ones(2, 6, dtype=torch.bool)
    patterns = [_random_patterns(gen, valid, h) for h in (4, 2, 3)]  # pruned: H varies
    got = rollout(patterns, add_residual=residual, head_fusion=fusion)
    assert got.dtype == torch.float64
    want = torch.from_numpy(_reference_rollout(patterns, fusion, residual))
    assert_close(got, want, **EXACT)
    assert_close(got.sum(-1), torch.ones(2, 6, dtype=torch.float64), **EXACT)
    float32 = rollout([p.float() for p in patterns], add_residual=residual, head_fusion=fusion)
    assert float32.dtype == torch.float32
    assert_close(float32, want.float(), rtol=1e-5, atol=1e-6)


def test_rollout_ignores_padding() -> None:
    gen = torch.Generator().manual_seed(7)
    valid = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.bool)
    patterns = [_random_patterns(gen, valid, 2, causal=True) for _ in range(3)]
    got = rollout(patterns, valid=valid)
    unpadded = rollout([p[..., 2:, 2:] for p in patterns])
    assert_close(got[0, 2:, 2:], unpadded[0], **EXACT)
    assert_close(got[0, :2], torch.zeros(2, 5, dtype=torch.float64), rtol=0, atol=0)
    assert_close(got[0, :, :2], torch.zeros(5, 2, dtype=torch.float64), rtol=0, atol=0)
    bare = rollout(patterns, valid=valid, add_residual=False)
    assert not bare.isnan().any()


def test_rollout_errors() -> None:
    with pytest.raises(ValueError, match="S == T"):
        rollout([torch.full((1, 1, 3, 4), 0.25)])
    with pytest.raises(ValueError, match="head_fusion"):
        rollout([torch.eye(3)[None, None]], head_fusion="sum")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="same \\(B, S\\)"):
        rollout([torch.eye(3)[None, None], torch.eye(4)[None, None]])


# ---------------------------------------------------------------------------------------
# clustering

KINDS = ("prev", "first", "uniform")


def _synthetic_heads(seed: int = 0) -> tuple[HeadStats, list[str], list[torch.Tensor]]:
    """3 layers x 6 heads: 6 previous-token, 6 first-token and 6 uniform causal heads,
    each blended with 10% random attention so no two heads are the same."""
    gen = torch.Generator().manual_seed(seed)
    n_batch, length = 4, 12
    valid = torch.ones(n_batch, length, dtype=torch.bool)
    causal = torch.ones(length, length, dtype=torch.float64).tril()
    ideal = {
        "prev": _one_hot([0, *range(length - 1)], length),
        "first": _one_hot([0] * length, length),
        "uniform": causal / causal.sum(-1, keepdim=True),
    }
    kinds, patterns = [], []
    for layer in range(3):
        layer_kinds = [KINDS[(layer + h) % 3] for h in range(6)]
        noise = _random_patterns(gen, valid, 6, causal=True)  # (B, 6, S, S)
        clean = torch.stack([ideal[k] for k in layer_kinds])[None]  # (1, 6, S, S)
        patterns.append(0.9 * clean + 0.1 * noise)
        kinds += layer_kinds
    return head_statistics(patterns, TokenRoles.from_mask(valid)), kinds, patterns


def test_cluster_heads_recovers_and_names_synthetic_kinds() -> None:
    stats, kinds, patterns = _synthetic_heads()
    clusters = cluster_heads(stats)
    assert len(clusters.labels) == len(stats.records) == 18
    assert len(clusters.coords) == 18 and all(len(xy) == 2 for xy in clusters.coords)
    by_kind = {k: {c for c, kk in zip(clusters.labels, kinds, strict=True) if kk == k}
               for k in KINDS}
    assert all(len(labels) == 1 for labels in by_kind.values())  # each kind in one cluster
    assert len(set().union(*by_kind.values())) == 3  # and the kinds apart
    names = {k: clusters.names[next(iter(labels))] for k, labels in by_kind.items()}
    assert names == {"prev": "previous-token heads", "first": "first-token sinks",
                     "uniform": "broad (high-entropy) heads"}
    assert clusters.labels[0] == 0  # numbered by first appearance
    assert "silhouette" in clusters.method

    # Deterministic for a seed, and the JSON form is plain data.
    assert cluster_heads(stats) == clusters
    data = clusters.to_json()
    assert set(data) == {"labels", "coords", "names", "method"}
    assert HeadClusters.from_json(json.dumps(data)) == clusters
    page = clusters._repr_html_()
    assert "previous-token heads" in page and "<svg" in page and "<script" not in page

    # Relative-position features agree with the statistics on this partition.
    features = pattern_features(patterns, max_offset=3)
    assert features.shape == (18, 8)
    assert_close(features.sum(axis=1), np.ones(18), rtol=0, atol=1e-12)
    with_features = cluster_heads(stats, pattern_features=features)
    assert with_features.labels == clusters.labels
    assert "8 pattern features" in with_features.method

    two = cluster_heads(stats, n_clusters=2)
    assert len(set(two.labels)) == 2 and len(two.names) == 2


def test_pattern_features_of_known_heads() -> None:
    length = 5
    prev = _one_hot([0, 0, 1, 2, 3], length)
    spread = torch.zeros(length, length, dtype=torch.float64)
    spread[:, 0] = 1.0  # query q sends all to key 0: offset -q
    features = pattern_features([torch.stack([prev, spread])[None]], max_offset=1)
    # columns: offset -1, 0, +1, beyond
    assert_close(features, np.array([[4 / 5, 1 / 5, 0.0, 0.0], [1 / 5, 1 / 5, 0.0, 3 / 5]]),
                 **EXACT)


def test_cluster_names_are_unique() -> None:
    rng = np.random.default_rng(0)
    # Two groups of previous-token heads, strong and weaker, and a broad group; all with
    # the same confidence, so that previous-token mass is what sets the first two apart.
    groups = {
        "previous-token heads": {"prev": 1.0, "entropy": 0.5},
        "previous-token heads 2": {"prev": 0.7, "entropy": 0.8},
        "broad (high-entropy) heads": {"prev": 0.1, "entropy": 2.5},
    }
    records, truth = [], []
    for name, values in groups.items():
        for _ in range(3):
            record = {"layer": len(records) // 3, "head": len(records) % 3,
                      **dict.fromkeys(STAT_NAMES, 0.0), "confidence": 0.5}
            record.update({k: v + 1e-3 * rng.standard_normal() for k, v in values.items()})
            records.append(record)
            truth.append(name)
    clusters = cluster_heads(HeadStats(records), n_clusters=3)
    got = [clusters.names[c] for c in clusters.labels]
    assert got == truth


def test_cluster_heads_edge_cases() -> None:
    one = HeadStats([{"layer": 0, "head": 0, **dict.fromkeys(STAT_NAMES, 0.5)}])
    single = cluster_heads(one)
    assert single.labels == [0] and single.names == {0: "all heads"}
    assert single.coords == [[0.0, 0.0]]
    nan = HeadStats([{"layer": 0, "head": h, **dict.fromkeys(STAT_NAMES, math.nan)}
                     for h in range(3)])
    with pytest.raises(ValueError, match="non-finite"):
        cluster_heads(nan)
    stats, _, _ = _synthetic_heads()
    with pytest.raises(ValueError, match="pattern_features has shape"):
        cluster_heads(stats, pattern_features=np.zeros((5, 2)))
    with pytest.raises(ValueError, match="n_clusters"):
        cluster_heads(stats, n_clusters=19)
