"""The `headlab` command through subprocess, as a user runs it."""

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
from torch.testing import assert_close

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def headlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "headlab", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=ROOT)


def test_help_lists_subcommands():
    r = headlab("--help")
    assert r.returncode == 0
    for cmd in ("prune", "score", "eval", "inspect", "report", "bench", "run"):
        assert cmd in r.stdout


def test_version_importable():
    r = subprocess.run([sys.executable, "-c", "import headlab; print(headlab.__version__)"],
                       capture_output=True, text=True, env=ENV)
    assert r.returncode == 0 and r.stdout.strip().count(".") == 2


@pytest.fixture(scope="module")
def pruned_run(tiny_gpt2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    r = headlab("prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--max-tokens", "2048",
                "--seq-len", "64", "--batch-size", "8", "--out", str(out), "--json",
                "--compare", "random")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_prune_writes_results_report_and_model(pruned_run):
    out, summary = pruned_run
    results = json.loads((out / "results.json").read_text())
    for key in ("model", "method", "keep", "heads_total", "heads_kept", "kept_heads",
                "importance", "quality", "curve", "params"):
        assert key in results, key
    assert (out / "report.html").stat().st_size > 10_000
    assert (out / "model" / "model.safetensors").is_file()
    assert json.loads((out / "status.json").read_text())["status"] == "complete"
    assert json.loads((out / "config.json").read_text())["keep"] == 0.5
    # the summary printed is the one in results.json
    assert summary["heads_kept"] == results["heads_kept"] == 6
    assert summary["quality_before"] == pytest.approx(results["quality"]["before"], rel=1e-12)
    assert summary["quality_after"] == pytest.approx(results["quality"]["after"], rel=1e-12)
    assert summary["params_after"] == results["params"]["after"] < results["params"]["before"]
    assert [p["fraction_pruned"] for p in results["curve"]][-1] == pytest.approx(0.5)
    data = results["data"]  # 2048 tokens in blocks of 64, split in half
    assert (data["scoring_examples"], data["heldout_examples"]) == (16, 16)
    assert data["scoring_tokens"] == data["heldout_tokens"] == 16 * 64
    # the default method, in its own schedule: gates, trained once toward the target
    assert (results["method"], results["schedule"]) == ("gates", "one-shot")
    assert set(results["curves"]) == {"gates", "random"}
    lat = results["latency_ms"]
    assert lat["before"] > 0 and lat["after"] > 0 and (lat["batch"], lat["seq_len"]) == (4, 64)
    # the scores that chose each removal: a pruned head names its scoring, a kept one none
    removal = results["removal_scores"]
    kept = {(int(la), h) for la, heads in results["kept_heads"].items() for h in heads}
    chosen = {(la, h) for la, row in enumerate(removal["scoring"])
              for h, k in enumerate(row) if k is not None}
    assert chosen == {(la, h) for la, row in enumerate(results["importance"])
                      for h in range(len(row))} - kept
    assert removal["scorings"] == 1  # one-shot (test_compat: an iterative run's several)
    # and at the longer length attention weighs at, capped by the model's 128 positions
    by_length = lat["by_length"]
    assert [(x["batch"], x["seq_len"]) for x in by_length] == [(4, 64), (1, 128)]
    assert (by_length[0]["before"], by_length[0]["after"]) == (lat["before"], lat["after"])
    assert all(0 < x["predicted_drop"] < 1 and x["after"] > 0 for x in by_length)
    assert summary["latency_by_length"] == by_length  # the summary printed shows both


def test_pruned_model_reloads_with_kept_heads(pruned_run):
    import headlab

    out, _ = pruned_run
    results = json.loads((out / "results.json").read_text())
    model = headlab.load(out / "model")
    assert model.head_ids() == [results["kept_heads"][str(i)] for i in range(model.n_layers)]


def test_report_command_rebuilds(pruned_run):
    out, _ = pruned_run
    (out / "report.html").unlink()
    r = headlab("report", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "report.html").is_file()


def test_existing_run_dir_not_overwritten(pruned_run, tiny_gpt2_dir):
    out, _ = pruned_run
    r = headlab("prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--out", str(out))
    assert r.returncode == 2
    assert "already exists" in r.stderr and "--overwrite" in r.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["prune", "--model", "no/such/thing/here", "--keep", "0.5"], "bundled offline models"),
        (["prune", "--model", "gpt2", "--keep", "0.5"], "smollm2-135m, minilm-l6"),
        (["prune", "--model", "minilm-l6", "--keep", "1.5"], "--keep must be in (0, 1]"),
        (["prune", "--model", "minilm-l6", "--keep", "0"], "--keep must be in (0, 1]"),
        (["prune", "--model", "minilm-l6"], "needs a target"),
        (["prune", "--model", "minilm-l6", "--keep", "0.5", "--data", "missing.txt"],
         "does not exist"),
        (["prune", "--model", "minilm-l6", "--keep", "0.5", "--device", "cuda"], "no CUDA GPU"),
        (["run", "recipes/does-not-exist.toml"], "does not exist"),
        (["prune", "--model", "minilm-l6", "--keep", "0.5", "--method", "taylor", "--per-token"],
         "--per-token applies to michel and fisher, not taylor"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, message):
    r = headlab(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert message in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_data_files(tmp_path, tiny_gpt2_dir):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    nocol = tmp_path / "rows.csv"
    nocol.write_text("a,b\n1,2\n3,4\n")
    for path, message in ((empty, "is empty"), (nocol, "no text column")):
        r = headlab("prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--data", str(path),
                    "--out", str(tmp_path / "never"))
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert not (tmp_path / "never").exists()  # bad input leaves no run directory


def test_recipe_unknown_key(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('# headlab run r.toml\nmodel = "minilm-l6"\nkep = 0.5\n')
    r = headlab("run", str(recipe))
    assert r.returncode == 2
    assert "unknown key(s) ['kep']" in r.stderr and "keep" in r.stderr


def test_every_recipe_parses_and_starts_with_its_command():
    from headlab.runs.config import load_recipe

    recipes = sorted((ROOT / "recipes").glob("*.toml"))
    assert {p.stem for p in recipes} >= {"gpt2-wikitext2", "bert-mnli", "smollm2-offline",
                                          "minilm-embeddings", "compare-methods"}
    for path in recipes:
        first = path.read_text().splitlines()[0]
        assert first == f"# headlab run recipes/{path.name}", path
        assert load_recipe(path, [])["model"]


def test_text_longer_than_positions_is_truncated(tiny_gpt2_dir, tmp_path):
    r = headlab("score", "--model", str(tiny_gpt2_dir), "--seq-len", "1000", "--max-tokens",
                "2048", "--out", str(tmp_path / "s"), "--method", "random")
    assert r.returncode == 0, r.stderr
    assert "exceeds the model's 128 positions" in r.stderr
    results = json.loads((tmp_path / "s" / "results.json").read_text())
    assert results["data"]["seq_len"] == 128
    assert results["kept_heads"] is None and results["quality"]["after"] is None


def test_score_with_taylor_takes_the_probe_count(tiny_gpt2_dir, tmp_path):
    out = tmp_path / "t"
    r = headlab("score", "--model", str(tiny_gpt2_dir), "--max-tokens", "1024", "--seq-len",
                "32", "--method", "taylor", "--probes", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert json.loads((out / "config.json").read_text())["probes"] == 2
    results = json.loads((out / "results.json").read_text())
    assert results["method"] == "taylor" and results["importance_normalisation"] is None
    flat = [v for row in results["importance"] for v in row]
    assert len(flat) == 12 and all(isinstance(v, float) for v in flat)
    r = headlab("score", "--model", str(tiny_gpt2_dir), "--probes", "0")
    assert r.returncode == 2 and "probes must be >= 1" in r.stderr


def test_score_normalisation_options(tiny_gpt2_dir, tmp_path):
    """By default each layer's michel scores have unit l2 norm; --no-normalize gives the
    raw E|dL/dxi| (the same ranking within a layer); --global-minmax rescales to [0, 1]."""
    got = {}
    for name, flags in (("l2", []), ("raw", ["--no-normalize"]),
                        ("minmax", ["--global-minmax"])):
        r = headlab("score", "--model", str(tiny_gpt2_dir), "--method", "michel",
                    "--max-tokens", "1024", "--seq-len", "32", "--out", str(tmp_path / name),
                    *flags)
        assert r.returncode == 0, r.stderr
        results = json.loads((tmp_path / name / "results.json").read_text())
        got[name] = (torch.tensor(results["importance"], dtype=torch.float64),
                     results["importance_normalisation"])
    (l2, l2_name), (raw, raw_name), (minmax, minmax_name) = got["l2"], got["raw"], got["minmax"]
    assert (l2_name, raw_name, minmax_name) == ("layer-l2", None, "layer-l2+minmax")
    assert_close(l2.norm(dim=1), torch.ones(l2.shape[0], dtype=torch.float64))
    assert_close(raw / raw.norm(dim=1, keepdim=True), l2)
    assert not torch.allclose(raw.norm(dim=1), torch.ones(raw.shape[0], dtype=torch.float64))
    assert_close(minmax, (l2 - l2.min()) / (l2.max() - l2.min()))


def test_prune_takes_per_token_gates_beside_a_random_curve(tiny_gpt2_dir, tmp_path):
    """The run's per-token option and layer norm go to michel, not to the random
    comparison (random refuses --normalize as its own method)."""
    out = tmp_path / "pt"
    r = headlab("prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--max-tokens",
                "1024", "--seq-len", "32", "--method", "michel", "--per-token", "--normalize",
                "--compare", "random", "--out", str(out))
    assert r.returncode == 0, r.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["per_token"] is True and config["normalize"] is True
    results = json.loads((out / "results.json").read_text())
    assert set(results["curves"]) == {"michel", "random"}
    # iterative, michel's own schedule: the heads left were scored again, and each
    # removal names the scoring that chose it
    removal = results["removal_scores"]
    assert results["schedule"] == "iterative" and removal["scorings"] > 1
    assert {k for row in removal["scoring"] for k in row if k is not None} != {0}


def test_ctrl_c_leaves_interrupted_status_and_no_partial_results(tiny_gpt2_dir, tmp_path):
    from headlab.data.texts import bundled_text

    out = tmp_path / "int"
    # the bundled text 20 times: ablation on it runs for a minute even on a fast machine,
    # so the signal lands mid-run (on the bundled text alone the run could end first)
    text = tmp_path / "long.txt"
    text.write_text("\n\n".join([bundled_text()] * 20))
    proc = subprocess.Popen(
        [sys.executable, "-m", "headlab", "prune", "--model", str(tiny_gpt2_dir), "--keep",
         "0.5", "--method", "ablation", "--data", str(text), "--max-tokens", "400000",
         "--seq-len", "32", "--out", str(out)], env=ENV, cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "status.json").exists():
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    # 130, or death by SIGINT (-2), which a shell also reports as 130; 0 would mean the
    # run ended before the signal
    assert proc.returncode in (130, -signal.SIGINT), err
    assert "interrupted" in err and "Traceback" not in err
    assert json.loads((out / "status.json").read_text())["status"] == "interrupted"
    assert not (out / "results.json").exists()
    assert not list(out.glob(".*.tmp"))


@pytest.mark.real
@pytest.mark.slow
def test_offline_recipes_run_end_to_end(tmp_path):
    for recipe, extra in (("minilm-embeddings", ["max_tokens=2048", "step=0.25"]),
                          ("smollm2-offline", ["max_tokens=1024", "seq_len=64", "step=0.2"])):
        out = tmp_path / recipe
        r = headlab("run", f"recipes/{recipe}.toml", *extra, f'out="{out}"', "--json",
                    timeout=600)
        assert r.returncode == 0, r.stderr
        summary = json.loads(r.stdout)
        results = json.loads((out / "results.json").read_text())
        assert summary["heads_kept"] == results["heads_kept"]
        assert results["heads_kept"] == pytest.approx(0.6 * results["heads_total"], abs=1)


@pytest.mark.parametrize("method", ["lsq", "none"])
def test_prune_and_repair_then_eval_gives_the_stated_quality(tiny_gpt2_dir, tmp_path, method):
    """prune --recover: results.json holds before / pruned / after and the per-layer
    errors (never worse after the fit); the saved model evaluates to the stated figure."""
    out = tmp_path / "r"
    # michel's heads: on this random model lsq gives some back (taylor's, 512.0 -> 512.1)
    r = headlab("prune", "--model", str(tiny_gpt2_dir), "--method", "michel", "--keep", "0.5",
                "--max-tokens", "2048", "--seq-len", "64", "--recover", method, "--out",
                str(out), "--json")
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    q = results["quality"]
    if method == "none":
        assert results["recovery"] is None and q["pruned"] is None
    else:
        rec = results["recovery"]
        assert rec["method"] == "lsq" and rec["tokens"] == results["data"]["scoring_tokens"]
        assert len(rec["layers"]) == 3
        assert all(e["error_after"] <= e["error_before"] for e in rec["layers"])
        assert q["after"] < q["pruned"]  # perplexity: the repair gave some back
        assert "Recovery" in (out / "report.html").read_text()
    ev = headlab("eval", "--model", str(out / "model"), "--max-tokens", "2048", "--seq-len", "64",
                 "--json")
    assert ev.returncode == 0, ev.stderr
    assert json.loads(ev.stdout)["value"] == pytest.approx(q["after"], rel=1e-5)


def test_prune_on_a_busy_machine_says_so_and_records_the_load(tiny_gpt2_dir, tmp_path,
                                                              monkeypatch, capsys):
    """The latency a prune run prints is as noisy as the machine: when other processes
    use the cores the summary says so, with the benchmarks' words, and results.json keeps
    how many cores' worth they used; on a quiet machine it says nothing."""
    import headlab.runs.stages
    from headlab.cli.common import print_summary, summary
    from headlab.runs.config import RunConfig
    from headlab.runs.pipeline import run

    for load, says in ((1.9, True), (0.0, False)):
        monkeypatch.setattr(headlab.runs.stages, "others_load", lambda load=load: load)
        out, result = run(RunConfig(model=str(tiny_gpt2_dir), keep=0.5, recover="none",
                                    max_tokens=512, seq_len=32, out=str(tmp_path / str(load))))
        assert result.latency_ms.others_load == load
        assert json.loads((out / "results.json").read_text())["latency_ms"]["others_load"] == load
        capsys.readouterr()
        print_summary(summary(result, out), json_mode=False, quiet=False)
        printed = " ".join(capsys.readouterr().out.split())
        assert ("latency: the machine is busy (other processes use 1.9 of its" in printed) is says


def test_others_load_counts_another_process_not_this_one():
    """A process spinning beside this one is about one core's worth of other load, and
    half a core's worth makes the machine busy."""
    import subprocess
    import sys
    import time

    from headlab._util.timing import busy, cpu_sample, others_load, others_since

    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        assert others_load(1.0) > 0.6
    finally:
        spinner.kill()
        spinner.wait()
    assert busy(0.9).startswith("the machine is busy") and busy(0.2) is None
    # an instant says nothing (a benchmark resumed with every part kept runs no time)
    assert others_since(cpu_sample()) is None


def test_report_and_terminal_print_the_same_units(pruned_run):
    """Bytes and milliseconds read the same in the summary printed and in the report."""
    from headlab._util.units import human_bytes, human_ms

    out, summary = pruned_run
    html = (out / "report.html").read_text()
    for n in summary["kv_cache_bytes_per_token"]:
        assert human_bytes(n) in html
    assert human_ms(summary["latency_ms_after"]) in html
    assert "KiB" not in html
