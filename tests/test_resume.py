"""An interrupted run resumes to exactly the result of an uninterrupted one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1"}


def _recipe(tmp_path: Path, model_dir: Path, name: str, **keys) -> Path:
    lines = [f"# headlab run {name}.toml", f'model = "{model_dir}"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    path = tmp_path / f"{name}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True,
                          text=True, env=ENV, cwd=ROOT, timeout=600)


def _kill_when(out: Path, ready, *args: str) -> None:
    """Start a run, SIGKILL it once ``ready(checkpoint_states)`` holds."""
    proc = subprocess.Popen([sys.executable, "-m", "headlab", *args], env=ENV, cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 300
    try:
        while time.time() < deadline:
            ck = out / "checkpoint.pt"
            if ck.is_file():
                try:
                    states = torch.load(ck, weights_only=True)
                except (EOFError, RuntimeError):  # replaced while reading: try again
                    states = None
                if states is not None and ready(states):
                    break
            if proc.poll() is not None:
                pytest.fail(f"run ended before the checkpoint: {proc.stderr.read()}")
            time.sleep(0.05)
        else:
            pytest.fail("no checkpoint within 300 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


COMMON = dict(seq_len=32, max_tokens=4096, batch_size=2, checkpoint_every=2)

pytestmark = pytest.mark.slow


def test_killed_scoring_resumes_to_identical_scores(tiny_gpt2_dir, tmp_path):
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    keys = dict(command="score", method="michel", **COMMON)
    r = _run("run", str(_recipe(tmp_path, tiny_gpt2_dir, "full", out=str(full), **keys)), "-q")
    assert r.returncode == 0, r.stderr
    recipe = _recipe(tmp_path, tiny_gpt2_dir, "cut", out=str(cut), **keys)
    _kill_when(cut, lambda s: "score" in s and s["score"]["batch"] >= 4,
               "run", str(recipe), "-q")
    assert json.loads((cut / "status.json").read_text())["status"] == "running"
    assert not (cut / "results.json").exists()
    r = _run("score", "--resume", str(cut), "-q")
    assert r.returncode == 0, r.stderr
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    assert a["importance"] == b["importance"]  # bitwise: same sums in the same order
    assert a["data"]["scoring_tokens"] == b["data"]["scoring_tokens"]
    assert json.loads((cut / "status.json").read_text())["status"] == "complete"
    assert not (cut / "checkpoint.pt").exists()


def test_killed_iterative_pruning_resumes_to_identical_run(tiny_gpt2_dir, tmp_path):
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    keys = dict(command="prune", method="michel", keep=0.5, step=0.25, **COMMON)
    r = _run("run", str(_recipe(tmp_path, tiny_gpt2_dir, "full", out=str(full), **keys)), "-q")
    assert r.returncode == 0, r.stderr
    recipe = _recipe(tmp_path, tiny_gpt2_dir, "cut", out=str(cut), **keys)
    _kill_when(cut, lambda s: len(s.get("prune/michel", {}).get("curve", [])) >= 2,
               "run", str(recipe), "-q")
    r = _run("prune", "--resume", str(cut), "-q")
    assert r.returncode == 0, r.stderr
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    for key in ("importance", "kept_heads", "curve", "heads_kept"):
        assert a[key] == b[key], key
    assert a["quality"]["after"] == b["quality"]["after"]


def test_resume_of_complete_run_is_refused(tiny_gpt2_dir, tmp_path):
    out = tmp_path / "done"
    r = _run("score", "--model", str(tiny_gpt2_dir), "--method", "random", "--max-tokens",
             "2048", "--seq-len", "32", "--out", str(out), "-q")
    assert r.returncode == 0, r.stderr
    r = _run("score", "--resume", str(out))
    assert r.returncode == 2 and "nothing to resume" in r.stderr


def test_killed_distillation_resumes_to_identical_run(tiny_gpt2_dir, tmp_path):
    """SIGKILL during ``--recover distill`` (after lsq, mid-training) and ``--resume``:
    the same repaired model, quality and distillation losses as an uninterrupted run."""
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    keys = dict(command="prune", method="michel", keep=0.5, step=0.5, recover="distill",
                recover_params="attention", recover_tokens=8 * 2048, recover_lr=1e-3,
                **COMMON)
    r = _run("run", str(_recipe(tmp_path, tiny_gpt2_dir, "full", out=str(full), **keys)), "-q")
    assert r.returncode == 0, r.stderr
    recipe = _recipe(tmp_path, tiny_gpt2_dir, "cut", out=str(cut), **keys)
    _kill_when(cut, lambda s: s.get("recover/distill", {}).get("step", 0) >= 4,
               "run", str(recipe), "-q")
    assert not (cut / "results.json").exists()
    r = _run("prune", "--resume", str(cut), "-q")
    assert r.returncode == 0, r.stderr
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    assert a["recovery"]["options"]["steps"] > 4
    for key in ("kept_heads", "curve", "quality"):
        assert a[key] == b[key], key
    assert a["recovery"]["options"] == b["recovery"]["options"]
    assert a["recovery"]["layers"] == b["recovery"]["layers"]
    from safetensors.torch import load_file

    ours, theirs = (load_file(str(d / "model" / "model.safetensors")) for d in (full, cut))
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k


@pytest.mark.parametrize(("budget", "per"), [("lagrangian", "block"), ("projection", "block"),
                                            ("projection", "token")])
def test_killed_gate_training_resumes_to_identical_scores(tiny_gpt2_dir, tmp_path, budget,
                                                          per):
    """Learned gates (`headlab.importance.gates`): the log_alphas, multipliers and
    AdamW states saved every two steps, each step's noise seeded by its index (a draw
    per block or per token); with projection, the log_alphas alone carry the state."""
    full = tmp_path / "full"
    cut = tmp_path / "cut"
    keys = dict(command="score", method="gates", keep=0.5, gate_steps=40, gate_budget=budget,
                gate_sample=per, **COMMON)
    r = _run("run", str(_recipe(tmp_path, tiny_gpt2_dir, "full", out=str(full), **keys)), "-q")
    assert r.returncode == 0, r.stderr
    recipe = _recipe(tmp_path, tiny_gpt2_dir, "cut", out=str(cut), **keys)
    _kill_when(cut, lambda s: "score" in s and s["score"]["step"] >= 6,
               "run", str(recipe), "-q")
    assert not (cut / "results.json").exists()
    r = _run("score", "--resume", str(cut), "-q")
    assert r.returncode == 0, r.stderr
    a = json.loads((full / "results.json").read_text())
    b = json.loads((cut / "results.json").read_text())
    assert a["importance"] == b["importance"]  # bitwise: the same steps in the same order
    assert a["data"]["scoring_tokens"] == b["data"]["scoring_tokens"]
