"""Score validation: Spearman against scipy, true ablation costs against the ablation
scorer, and the table's rows on a tiny model."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

import headlab
from headlab.analysis.validation import Validation, ablation_costs, spearman, validate


def test_spearman_matches_scipy_with_ties():
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, 5, (40,), generator=gen).double()  # many ties
    ys = torch.randn(3, 40, generator=gen, dtype=torch.float64)
    ys[1, :10] = 0.0
    got = spearman(x, ys)
    want = torch.tensor([stats.spearmanr(x.numpy(), y.numpy()).statistic for y in ys],
                        dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.fixture()
def tiny_blocks(tiny_gpt2):
    blocks = headlab.make_blocks(headlab.load_texts(), tiny_gpt2.tokenizer, kind="causal-lm",
                                 seq_len=24, max_tokens=24 * 8)
    return headlab.prepare(tiny_gpt2, blocks)


def test_ablation_costs_average_to_the_ablation_scores(tiny_gpt2, tiny_blocks):
    costs, heads = ablation_costs(tiny_gpt2, tiny_blocks, batch_size=4)
    assert costs.shape == (len(tiny_blocks), 12) and heads[5] == (1, 1)
    want = headlab.score(tiny_gpt2, tiny_blocks, method="ablation", batch_size=4)
    got = torch.full((3, 4), math.nan, dtype=torch.float64)
    for k, (layer, head) in enumerate(heads):
        got[layer, head] = costs[:, k].mean()  # equal-length blocks: token mean == row mean
    # float32 losses near 6.2 nats: each carries ~5e-7 of rounding
    torch.testing.assert_close(got, want.tensor(), atol=2e-6, rtol=0)
    assert got.abs().max() > 1e-5


def test_validate_table(tiny_gpt2, tiny_blocks):
    got = validate(tiny_gpt2, tiny_blocks, tiny_blocks, methods=("ablation", "random"),
                   detectors=("previous-token",), batch_size=4, n_boot=200,
                   fractions=(0.25, 0.5))
    assert [r.name for r in got.rows] == ["ablation", "random", "previous-token"]
    # scored on the held-out blocks themselves, ablation is the ground truth
    torch.testing.assert_close(got.row("ablation").spearman, 1.0, atol=1e-12, rtol=0)
    lo, hi = got.row("random").ci
    assert lo < 0 < hi
    # a random model loses nothing to random pruning: no area to compare with
    assert len(got.row("ablation").curve) == 2 and len(got.random_curve) == 2
    if sum(got.random_curve) <= 0:
        assert math.isnan(got.row("ablation").auc_ratio)
    assert "| ablation | importance | +1.000 |" in got.table()
    back = Validation.from_json(got.to_json())
    assert back.table() == got.table()


@pytest.mark.slow
def test_cli_validate_prints_the_table(tiny_gpt2_dir, tmp_path):
    from typer.testing import CliRunner

    from headlab.cli import app

    out = tmp_path / "validation.json"
    result = CliRunner().invoke(app, ["validate", "--model", str(tiny_gpt2_dir), "--methods",
                                      "entropy", "--methods", "random", "--kinds", "sink",
                                      "--max-tokens", "192", "--seq-len", "24", "--n-boot",
                                      "50", "--out", str(out)])
    assert result.exit_code == 0, result.output
    saved = Validation.from_json(__import__("json").loads(out.read_text()))
    assert [r.name for r in saved.rows] == ["entropy", "random", "sink"]
    assert saved.table() in result.output
