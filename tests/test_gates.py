"""Tests for learned head gates (`headlab.importance.gates`, Voita et al. 2019 with
CoFi's Lagrangian).

Invariants: the hard-concrete gate's P(open) is the fraction of its samples that are
not 0; with a target of every head the gates stay open and selection keeps all;
projection (the default budget) holds the expected number of open gates on the target
exactly (its shift agrees with scipy's root finder), and the Lagrangian drives it there;
a model whose output one head alone carries keeps that head at every target, either way.
Equivalence: one gate per GQA group scores every head of a group alike. A draw per token
gives each position of a block its own gates, the same model's gates at every one of
them with a draw per block.

Shape notation: L layers, H heads per layer.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from headlab.data.texts import load_texts
from headlab.errors import UserError
from headlab.importance import score
from headlab.importance.gates import LOG_ALPHA_BOUNDS, on_budget, p_open, sample
from headlab.objectives import make_blocks, prepare
from headlab.selection import select

S = 24
# CoFi's multipliers, four blocks a step: the settings these tests' step counts assume
LAGRANGIAN = {"gate_budget": "lagrangian", "gate_batch": 4}


@pytest.fixture()
def blocks(tiny_gpt2):
    return prepare(tiny_gpt2, make_blocks(load_texts(), tiny_gpt2.tokenizer,
                                          kind="causal-lm", seq_len=S, max_tokens=8 * S))


def test_p_open_is_the_share_of_samples_not_zero():
    log_alpha = torch.tensor([-2.0, 0.0, 1.5])
    u = torch.rand(200_000, 3, generator=torch.Generator().manual_seed(0)).clamp(1e-6, 1 - 1e-6)
    z = sample(log_alpha, u)  # (N, 3)
    assert float(z.min()) == 0.0 and float(z.max()) == 1.0
    assert_close((z != 0).double().mean(0), p_open(log_alpha).double(), rtol=0, atol=5e-3)


@pytest.mark.parametrize("per", ["block", "token"])
def test_every_head_as_target_keeps_the_gates_open(tiny_gpt2, blocks, per):
    total = tiny_gpt2.n_layers * tiny_gpt2.n_original_heads
    s = score(tiny_gpt2, blocks, method="gates", target=total, batch_size=4, gate_steps=30,
              gate_sample=per)
    assert bool((p_open(s.tensor()) > 0.99).all())
    assert sum(len(v) for v in select(s, total).kept.values()) == total
    assert s.normalisation is None  # log_alphas compare across layers as they are


@pytest.mark.parametrize("target", [3, 6, 9])
def test_the_expected_open_gates_reach_the_target(tiny_gpt2, blocks, target):
    s = score(tiny_gpt2, blocks, method="gates", target=target, batch_size=4,
              gate_steps=200, **LAGRANGIAN)
    expected = float(p_open(s.tensor()).sum())
    assert expected == pytest.approx(target, rel=0.02)
    assert expected == pytest.approx(s.extra["expected_open"], rel=1e-9)
    assert s.extra["target_met"]


@pytest.mark.parametrize(("steps", "per"), [(2, "block"), (7, "block"), (40, "block"),
                                          (40, "token")])
def test_projection_holds_the_expected_open_gates_on_the_target(tiny_gpt2, blocks, steps,
                                                                per):
    """With the default budget, projection, every step ends on the warm-up's goal, so
    the training ends on the target whatever its length, and says so."""
    s = score(tiny_gpt2, blocks, method="gates", target=3, batch_size=4, gate_steps=steps,
              gate_sample=per)
    assert float(p_open(s.tensor()).sum()) == pytest.approx(3, rel=1e-6)
    assert s.extra["target_met"] and s.extra["budget"] == "projection"
    assert s.extra["sample"] == per
    assert s.extra["lambdas"] is None and s.extra["lagrange_lr"] is None  # none trained


@pytest.mark.parametrize("per", ["block", "token"])
def test_a_draw_covers_a_block_or_one_token(tiny_gpt2, blocks, monkeypatch, per):
    """The gates each step's forward runs with: one row per block, or one per block and
    position, each position's row a draw of its own; in [0, 1], some exactly 0 or 1."""
    from headlab.objectives import objective_for

    objective = type(objective_for(tiny_gpt2))
    forward, seen = objective.forward, []

    def kept(self, model, batch):
        gate = model.attentions[1].gate_override
        if gate is not None:  # a student's step, not the model's own outputs
            seen.append((gate.detach().clone(), tuple(batch["input_ids"].shape)))
        return forward(self, model, batch)

    monkeypatch.setattr(objective, "forward", kept)
    score(tiny_gpt2, blocks, method="gates", target=6, batch_size=4, gate_steps=6,
          gate_sample=per)
    assert len(seen) == 6
    H = tiny_gpt2.attentions[1].n_heads
    for gate, (B, L) in seen:
        assert gate.shape == ((B, H) if per == "block" else (B, L, H))
        assert float(gate.min()) >= 0 and float(gate.max()) <= 1
    gates = torch.cat([g.reshape(-1, H) for g, _ in seen])
    assert bool((gates == 0).any() or (gates == 1).any())
    if per == "token":  # the positions of a block draw apart
        first = seen[0][0][0]  # (L, H): the first block's
        assert any(not torch.equal(first[0], row) for row in first[1:])


def test_the_projection_shift_is_the_root_scipy_finds():
    """`on_budget` moves every log alpha by one constant c, within the bounds: the root
    of sum P(open)(clamp(log_alpha + c)) - goal, as scipy's brentq finds it in float64."""
    from scipy.optimize import brentq

    log_alpha = torch.randn(50, generator=torch.Generator().manual_seed(0)).double() * 3
    for goal in (1.0, 17.5, 49.0):
        shifted = on_budget(log_alpha, goal)

        def gap(c, goal=goal):
            return float(p_open((log_alpha + c).clamp(*LOG_ALPHA_BOUNDS)).sum()) - goal

        c = brentq(gap, -40, 40, xtol=1e-13)
        assert_close(shifted, (log_alpha + c).clamp(*LOG_ALPHA_BOUNDS), rtol=0, atol=1e-9)
        assert float(p_open(shifted).sum()) == pytest.approx(goal, rel=1e-9)


def test_the_multipliers_train_at_their_own_rate(tiny_gpt2, blocks):
    """--gate-lagrange-lr moves the multipliers alone: unset, they train at the gates'
    rate; faster, they grow further in the same steps."""
    runs = [score(tiny_gpt2, blocks, method="gates", target=3, batch_size=4, gate_steps=20,
                  **LAGRANGIAN, **kw)
            for kw in ({}, {"gate_lagrange_lr": 0.1}, {"gate_lagrange_lr": 1.0})]
    shared, same, faster = runs
    assert shared.extra["lagrange_lr"] == shared.extra["lr"] == 0.1
    assert_close(shared.tensor(), same.tensor(), rtol=0, atol=0)
    assert faster.extra["lagrange_lr"] == 1.0
    assert faster.extra["lambdas"][0] > 5 * shared.extra["lambdas"][0] > 0


@pytest.mark.parametrize(("steps", "above", "says"), [
    (2, True, "did not pull them down"),  # too few steps to shut 9 of 12 gates
    (60, False, "overshot"),  # the multipliers still pull down when the count passes 3
])
def test_gates_that_end_off_the_target_say_so(tiny_gpt2, blocks, caplog, steps, above, says):
    """A training that ends off its target warns, naming which way and what would move
    it, and the scores record it."""
    with caplog.at_level("WARNING", logger="headlab.importance.gates"):
        s = score(tiny_gpt2, blocks, method="gates", target=3, batch_size=4,
                  gate_steps=steps, **LAGRANGIAN)
    assert not s.extra["target_met"]
    assert (s.extra["expected_open"] > 3 * 1.02) if above else \
        (s.extra["expected_open"] < 3 * 0.98)
    (record,) = [r for r in caplog.records if r.name == "headlab.importance.gates"]
    message = record.getMessage()
    assert "against a target of 3" in message and says in message
    assert "--gate-steps" in message and "--gate-lagrange-lr" in message
    assert ("a faster" if above else "a slower") in message


def test_the_model_s_own_outputs_kept_or_not_train_the_same_gates(tiny_gpt2, blocks,
                                                                 monkeypatch):
    """The targets, the model's outputs with every gate at 1, are computed once per
    batch where they fit in `TEACHER_SHARE` of the memory, else at every step; the
    gates learnt are the same bit for bit."""
    from headlab.objectives import objective_for

    objective = type(objective_for(tiny_gpt2))
    forward, calls = objective.forward, []

    def counted(self, model, batch):
        calls.append(model.attentions[0].gate_override is None)
        return forward(self, model, batch)

    monkeypatch.setattr(objective, "forward", counted)
    learnt = []
    for share in (0.25, 0.0):
        monkeypatch.setattr("headlab.importance.gates.TEACHER_SHARE", share)
        calls.clear()
        learnt.append(score(tiny_gpt2, blocks, method="gates", target=6, batch_size=4,
                            gate_steps=10).tensor())
        assert len(blocks) == 8  # one block a step: 8 batches, the first 2 seen twice
        assert sum(calls) == (8 if share else 10)  # the gates-at-1 forwards
    assert torch.equal(learnt[0], learnt[1])


@pytest.mark.parametrize("budget", [LAGRANGIAN, {}, {"gate_sample": "token"}])
def test_the_head_that_carries_the_output_is_kept(tiny_gpt2, blocks, budget):
    """Every head's W_O columns scaled to almost nothing but layer 1's head 2, scaled
    up: the model's output is that head's; every target keeps it."""
    D = tiny_gpt2.attentions[0].head_dim
    with torch.no_grad():
        for i, a in enumerate(tiny_gpt2.attentions):
            for h in range(a.n_heads):
                a.o_proj.weight[:, h * D:(h + 1) * D] *= 20.0 if (i, h) == (1, 2) else 0.01
    carried = prepare(tiny_gpt2, blocks)  # unchanged for causal LMs
    for target in (1, 2, 6, 11):
        s = score(tiny_gpt2, carried, method="gates", target=target, batch_size=4,
                  gate_steps=100, **budget)
        assert 2 in select(s, target).kept[1], target


def test_one_gate_per_group_scores_a_group_alike(gqa_dir):
    import headlab

    model = headlab.load(gqa_dir)
    blocks = prepare(model, make_blocks(load_texts(), model.tokenizer, kind="causal-lm",
                                        seq_len=S, max_tokens=4 * S))
    s = score(model, blocks, method="gates", target=3, unit="kv-group", batch_size=4,
              gate_steps=200)
    t = s.tensor()  # (L, H), groups of two heads
    assert_close(t[:, 0::2], t[:, 1::2], rtol=0, atol=0)
    assert float(p_open(t[:, 0::2]).sum()) == pytest.approx(3, rel=0.02)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"target": 0}, "target of 1 to 12"),
    ({"target": 13}, "target of 1 to 12"),
    ({"target": None}, "give a target"),
    ({"target": 6, "gate_steps": 0}, "--gate-steps"),
    ({"target": 6, "gate_lr": 0.0}, "--gate-lr"),
    ({"target": 6, "gate_lr": -1e-3}, "--gate-lr"),
    ({"target": 6, "gate_lagrange_lr": 0.0}, "--gate-lagrange-lr"),
    ({"target": 6, "gate_lagrange_lr": float("nan")}, "--gate-lagrange-lr"),
    ({"target": 6, "gate_budget": "exact"}, "--gate-budget must be one of lagrangian, "
                                             "projection"),
    ({"target": 6, "gate_batch": 0}, "--gate-batch must be at least 1 block per step"),
    ({"target": 6, "gate_sample": "sentence"}, "--gate-sample must be one of block, token"),
])
def test_bad_options_say_so(tiny_gpt2, blocks, kwargs, message):
    with pytest.raises(UserError, match=message):
        score(tiny_gpt2, blocks, method="gates", batch_size=4, **kwargs)


@pytest.mark.parametrize(("steps", "budget", "met", "per"), [
    (20, [], True, "block"),  # projection and block draws, the defaults, end on the target
    # too few steps
    (2, ["--gate-budget", "lagrangian", "--gate-batch", "4", "--gate-sample", "token"], False,
     "token"),
])
def test_a_run_records_where_the_gates_ended(tiny_gpt2_dir, tmp_path, steps, budget, met,
                                             per):
    """`headlab prune --method gates` keeps the training's end in results.json
    (``scoring_details``), says it in the summary and in the report's facts; a file
    read back renders the same line."""
    import json

    from typer.testing import CliRunner

    from headlab.cli import app
    from headlab.importance.gates import ended
    from headlab.report import render
    from headlab.results import RunResult

    out = tmp_path / "run"
    r = CliRunner().invoke(app, ["prune", "--model", str(tiny_gpt2_dir), "--method", "gates",
                                 "--keep", "0.25", "--gate-steps", str(steps), "--seq-len",
                                 str(S), "--max-tokens", str(8 * S), "--batch-size", "4",
                                 *budget, "--recover", "none", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    written = json.loads((out / "results.json").read_text())
    assert written["schedule"] == "one-shot"  # gates train once unless told otherwise
    details = written["scoring_details"]
    assert details["target"] == 3 and details["steps"] == steps
    assert details["target_met"] is met
    assert (abs(details["expected_open"] - 3) <= 0.06) is met
    line = ended(details)
    assert line.startswith(f"{details['expected_open']:.1f} heads expected open against a "
                           f"target of 3 after {steps} steps of draws per {per}")
    assert ("(target met)" if met else "(target missed") in line
    assert json.loads(r.stdout[r.stdout.index("{"):])["gate_training"] == line
    assert line in (out / "report.html").read_text()
    result = RunResult.from_json(written)
    assert result.scoring_details == details and line in render(result)


def test_other_scorings_say_nothing_of_gates():
    from headlab.importance.gates import ended

    assert ended({"per_token": False, "seed": 0, "probes": 4}) is None
    assert ended({"expected_open": "12", "target": 3, "steps": 5}) is None  # malformed
