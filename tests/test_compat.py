"""Run directories written by main before the package layout of issue 32 still load,
re-render and resume. The fixture (tests/fixtures/run-main/, written by its
make_fixture.py with that code) is a finished ``headlab prune --recover lsq`` run and an
iterative pruning of its model killed after its first step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import headlab
from headlab.results import RunResult

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "run-main"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _headlab(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=600)


def test_model_directory_loads_and_gives_stored_logits():
    model = headlab.load(FIXTURE / "complete" / "model")
    expected = torch.load(FIXTURE / "expected.pt", weights_only=True)
    with torch.no_grad():
        out = model(expected["input_ids"])
    logits = getattr(out, "logits", out)
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-5, atol=1e-5)
    assert model.heads_per_layer == [len(h) for h in
                                     json.loads((FIXTURE / "complete" / "results.json")
                                                .read_text())["kept_heads"].values()]


def test_results_load_and_report_rerenders(tmp_path):
    stored = json.loads((FIXTURE / "complete" / "results.json").read_text())
    result = RunResult.from_json(stored)
    assert result.recovery is not None and result.recovery.method == "lsq"
    assert result.heads_total == 8 and result.heads_kept == 4
    assert result.quality.pruned == stored["quality"]["pruned"]
    again = result.to_json()
    for key in ("model", "method", "keep", "heads_total", "heads_kept", "kept_heads",
                "importance", "quality", "curve", "params", "kv_cache_bytes_per_token",
                "recovery"):
        assert again[key] == stored[key], key

    run_dir = tmp_path / "complete"
    shutil.copytree(FIXTURE / "complete", run_dir)
    r = _headlab("report", str(run_dir))
    assert r.returncode == 0, r.stderr
    html = (run_dir / "report.html").read_text()
    assert html.startswith("<!DOCTYPE html>") or html.lstrip().lower().startswith("<!doctype")
    assert "lsq" in html and "perplexity" in html


def test_interrupted_run_resumes(tmp_path):
    """The interrupted run's config names its model by a path relative to the repository
    root (the fixture's finished run), so it resumes from there."""
    run_dir = tmp_path / "interrupted"
    shutil.copytree(FIXTURE / "interrupted", run_dir)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "running"
    r = _headlab("prune", "--resume", str(run_dir), "-q")
    assert r.returncode == 0, r.stderr
    assert json.loads((run_dir / "status.json").read_text())["status"] == "complete"
    assert not (run_dir / "checkpoint.pt").exists()
    resumed = json.loads((run_dir / "results.json").read_text())
    assert resumed["heads_total"] == 8 and resumed["heads_kept"] == 2  # of the original 8

    # the same run uninterrupted: the resumed run continued where the checkpoint stood
    config = json.loads((FIXTURE / "interrupted" / "config.json").read_text())
    full = tmp_path / "full"
    r = _headlab("prune", "--model", config["model"], "--method", config["method"],
                 "--keep", "0.25", "--step", "0.25",
                 "--out", str(full), "--seq-len", "32", "--max-tokens", "2048",
                 "--batch-size", "2", "-q")
    assert r.returncode == 0, r.stderr
    uninterrupted = json.loads((full / "results.json").read_text())
    # the checkpoint's scores and curve were summed in float32 on the machine that wrote
    # the fixture; another CPU's kernels may round the last bits differently
    assert resumed["kept_heads"] == uninterrupted["kept_heads"]
    assert resumed["heads_kept"] == uninterrupted["heads_kept"]
    for key in ("importance", "curve"):
        assert _close(resumed[key], uninterrupted[key]), key
    assert _close(resumed["quality"]["after"], uninterrupted["quality"]["after"])
    # and the resumed run took them from the checkpoint rather than scoring again
    saved = torch.load(FIXTURE / "interrupted" / "checkpoint.pt", weights_only=False)
    assert resumed["importance"] == saved["prune/michel"]["step_scores"][-1]["scores"]


def _close(a, b, rel: float = 1e-6) -> bool:
    """``a == b`` with floats equal to ``rel``, through lists and dicts."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(
            _close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(
            _close(x, y, rel) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rel * max(abs(a), abs(b))
    return a == b
