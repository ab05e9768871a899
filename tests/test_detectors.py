"""Head-type detectors: wired heads with known answers, the scores against a direct
computation from captured patterns, and the bundled models."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import headlab
from headlab.detectors import Probe, detect, kinds_for, probes, top_heads

REPEAT = 12  # tokens per repeat in the tests' random sequences


def _wire(kind_of_head: dict[int, str], start: int = 1, length: int = REPEAT):
    """A scores hook that makes head h of layer 0 attend to one key per query: the
    previous token, the first position, or the induction target of a repeated sequence."""
    def fn(scores: torch.Tensor, _name: str) -> torch.Tensor:
        scores = scores.clone()  # (B, H, S, T)
        S, T = scores.shape[-2:]
        q = torch.arange(S)
        for head, kind in kind_of_head.items():
            if kind == "previous":
                key = (q - 1).clamp(min=0)
            elif kind == "first":
                key = torch.zeros_like(q)
            else:  # induction: the token after the earlier occurrence, else itself
                key = torch.where(q >= start + length, q - length + 1, q)
            wired = torch.full((S, T), float("-inf"))
            wired[q, key] = 0.0
            scores[:, head] = wired
        return scores
    return fn


def test_wired_heads_score_their_type_one_and_others_zero(tiny_gpt2):
    wire = _wire({0: "previous", 1: "first", 2: "induction"})
    with headlab.hooks(tiny_gpt2, {"blocks.0.attn.scores": wire}):
        got = {k: detect(tiny_gpt2, k, n=4, seq_len=32, repeat_len=REPEAT).tensor()[0]
               for k in ("previous-token", "induction", "duplicate-token", "sink")}
    one, zero = torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)
    for kind, head, want in [("previous-token", 0, one), ("induction", 0, zero),
                             ("duplicate-token", 0, zero), ("sink", 1, one),
                             ("induction", 2, one), ("duplicate-token", 2, zero),
                             ("induction", 1, zero)]:
        torch.testing.assert_close(got[kind][head], want, atol=1e-6, rtol=0,
                                   msg=f"{kind} of wired head {head}")
    # a previous-token head on the repeated sequences is no induction head, and the
    # induction head attends to the previous token only where the repeat begins
    assert got["previous-token"][2] < 0.2


def _direct(model, kind: str, batches: list[Probe], length: int) -> np.ndarray:
    """Each kind's definition applied in float64 loops to `capture(model, "pattern")`."""
    sums = np.zeros((model.n_layers, model.n_original_heads))
    rows = 0
    tok = model.tokenizer
    for probe in batches:
        with headlab.capture(model, "pattern") as cap:
            out = model(probe.input_ids, attention_mask=probe.attention_mask)
        ids, valid = probe.input_ids.numpy(), probe.attention_mask.numpy().astype(bool)
        B, S = ids.shape
        for layer in range(model.n_layers):
            p = cap[f"blocks.{layer}.attn.pattern"].double().numpy()
            for b in range(B):
                first = int(np.argmax(valid[b]))
                for s in range(S):
                    if kind in ("induction", "duplicate-token"):
                        if not 1 + length <= s < 1 + 2 * length:
                            continue
                        key = s - length + (kind == "induction")
                        sums[layer] += p[b, :, s, key]
                    elif kind == "previous-token":
                        if valid[b, s] and s > first:
                            sums[layer] += p[b, :, s, s - 1]
                    elif kind in ("cls", "sep", "next-token"):
                        if not (valid[b, s] and s > first):
                            continue
                        if kind == "next-token":
                            if s + 1 < S and valid[b, s + 1]:
                                sums[layer] += p[b, :, s, s + 1]
                            continue
                        special = tok.cls_token_id if kind == "cls" else tok.sep_token_id
                        keys = [t for t in range(S) if valid[b, t] and ids[b, t] == special]
                        sums[layer] += p[b][:, s][:, keys].sum(-1)
                    elif kind == "sink":
                        if valid[b, s] and s > first:
                            keys = [t for t in range(S) if valid[b, t] and (
                                t == first or ids[b, t] == tok.bos_token_id)]
                            sums[layer] += p[b][:, s][:, keys].sum(-1)
                    elif probe.rows[b, s]:  # retrieval
                        answer = int(probe.answer[b, s])
                        if answer >= 0 and int(out.logits[b, s].argmax()) != answer:
                            continue
                        strongest = p[b, :, s].argmax(-1)
                        sums[layer] += probe.target[b, s, strongest].double().numpy()
        if kind in ("induction", "duplicate-token"):
            rows += B * length
        elif kind == "retrieval":
            rows += int(probe.rows.sum())
        else:
            rows += int(sum(valid[b].sum() - 1 for b in range(B)))
    return sums / rows


def _wire_retrieval(probe: Probe):
    """Head 0 of layer 0 attends, on the answer rows, to the needle copy of the answer."""
    def fn(scores: torch.Tensor, _name: str) -> torch.Tensor:
        scores = scores.clone()  # (B, H, S, T)
        on_needle = torch.where(probe.target > 0, 0.0, float("-inf"))
        scores[:, 0] = torch.where(probe.rows[..., None], on_needle, scores[:, 0])
        return scores
    return fn


@pytest.mark.parametrize("kind", ["previous-token", "induction", "duplicate-token", "sink",
                                  "retrieval"])
def test_scores_equal_direct_computation_from_captured_patterns(tiny_gpt2, kind):
    batches = probes(tiny_gpt2, kind, n=3, seq_len=40, repeat_len=REPEAT, batch_size=3)
    fns = {}
    if kind == "retrieval":  # a random model copies nothing: no prediction asked for
        probe = batches[0]
        needle = probe.target.nonzero()  # (b, s, t): the needle holds the answer token
        torch.testing.assert_close(probe.input_ids[needle[:, 0], needle[:, 2]],
                                   probe.answer[needle[:, 0], needle[:, 1]], rtol=0, atol=0)
        probe.answer = torch.full_like(probe.answer, -1)
        fns = {"blocks.0.attn.scores": _wire_retrieval(probe)}
    with headlab.hooks(tiny_gpt2, fns):
        got = detect(tiny_gpt2, kind, batches=batches, repeat_len=REPEAT)
        want = _direct(tiny_gpt2, kind, batches, REPEAT)
    torch.testing.assert_close(got.tensor(), torch.from_numpy(want), atol=1e-6, rtol=0)
    assert got.tensor().min() >= 0 and got.tensor().max() <= 1
    if kind == "retrieval":
        assert got.scores[0][0] == 1.0 and got.tensor()[1:].max() < 1


def test_retrieval_counts_only_rows_where_the_model_copies(tiny_gpt2):
    batches = probes(tiny_gpt2, "retrieval", n=2, seq_len=40)
    for probe in batches:  # answers no model predicts: no step counts
        probe.answer = torch.where(probe.answer >= 0, torch.full_like(probe.answer, 10**6),
                                   probe.answer)
    got = detect(tiny_gpt2, "retrieval", batches=batches)
    torch.testing.assert_close(got.tensor(), torch.zeros(3, 4, dtype=torch.float64))
    assert got.n_tokens == sum(int(p.rows.sum()) for p in batches)


def test_pruned_heads_are_nan_and_kinds_are_checked(tiny_gpt2):
    tiny_gpt2.prune_heads({1: [2]})
    got = detect(tiny_gpt2, "previous-token", n=2, seq_len=16)
    assert math.isnan(got.scores[1][2]) and not math.isnan(got.scores[1][1])
    assert (1, 2) not in [(layer, head) for layer, head, _ in top_heads(got, 12)]
    with pytest.raises(headlab.errors.UserError, match="does not apply"):
        detect(tiny_gpt2, "cls")
    assert "retrieval" in kinds_for(tiny_gpt2) and "cls" not in kinds_for(tiny_gpt2)


def test_repeated_tokens_exclude_special_tokens_and_are_seeded(tiny_gpt2):
    a = probes(tiny_gpt2, "induction", n=4, repeat_len=REPEAT, seed=3)
    b = probes(tiny_gpt2, "induction", n=4, repeat_len=REPEAT, seed=3)
    ids = a[0].input_ids
    torch.testing.assert_close(ids, b[0].input_ids, rtol=0, atol=0)
    body = ids[:, 1:]
    special = torch.tensor(tiny_gpt2.tokenizer.all_special_ids)
    assert not torch.isin(body, special).any()
    torch.testing.assert_close(body[:, :REPEAT], body[:, REPEAT:], rtol=0, atol=0)


@pytest.mark.slow
def test_smollm2_has_induction_and_previous_token_heads():
    model = headlab.load("smollm2-135m")
    for kind in ("induction", "previous-token"):
        best = top_heads(detect(model, kind, n=8), 1)[0]
        assert best[2] >= 0.5, (kind, best)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cls", "sep", "next-token", "previous-token"])
def test_minilm_encoder_roles_equal_direct_computation(kind):
    model = headlab.load("minilm-l6")
    batches = probes(model, kind, n=4, seq_len=24)
    got = detect(model, kind, batches=batches)
    want = _direct(model, kind, batches, REPEAT)
    torch.testing.assert_close(got.tensor(), torch.from_numpy(want), atol=1e-6, rtol=0)
    assert got.tensor().max() > 0.2, "some MiniLM head attends to each role"


def test_cli_detect_lists_top_heads_and_writes_scores(tiny_gpt2_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from headlab.cli import app

    out = tmp_path / "types.json"
    result = CliRunner().invoke(app, ["detect", "--model", str(tiny_gpt2_dir), "--kinds",
                                      "previous-token", "--kinds", "sink", "--n", "2",
                                      "--seq-len", "16", "--top", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = json.loads(out.read_text())
    assert sorted(saved) == ["previous-token", "sink"]
    best = top_heads(headlab.HeadScores.from_json(saved["sink"]), 1)[0]
    assert f"L{best[0]}H{best[1]} {best[2]:.3f}" in result.output
    bad = CliRunner().invoke(app, ["detect", "--model", str(tiny_gpt2_dir), "--kinds", "cls"])
    assert bad.exit_code == 2 and "does not apply" in bad.output
