"""What `headlab CMD --help` says: whole option names at 80 columns, defaults that are
the configuration's, texts true to the code; `eval --list-tasks` without a model; one
warning format."""

from __future__ import annotations

import logging
import re
from enum import Enum

import pytest
import typer
from typer.testing import CliRunner

from headlab.cli import app
from headlab.cli.common import setup
from headlab.runs.config import RunConfig

COMMANDS = ["prune", "score", "eval", "detect", "validate", "inspect", "report", "bench",
            "run"]
RUN_COMMANDS = ["prune", "score", "eval"]


def _help(command: str) -> str:
    r = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "80", "TERM": "dumb"},
                           terminal_width=80)
    assert r.exit_code == 0, r.output
    return r.output


def _params(command: str):
    group = typer.main.get_command(app)
    return [p for p in group.commands[command].params if p.name != "help"]


@pytest.mark.parametrize("command", COMMANDS)
def test_help_fits_80_columns_with_whole_option_names(command):
    text = _help(command)
    cut = text.replace("]...", "]")  # click's mark of a repeatable argument
    for param in _params(command):
        if isinstance(param, typer.core.TyperArgument):
            cut = cut.replace(f"{param.name}...", param.name)
    assert "…" not in cut and "..." not in cut
    assert max(len(line) for line in text.splitlines()) <= 80
    for param in _params(command):
        for name in (*param.opts, *param.secondary_opts):
            if name.startswith("--"):
                assert re.search(rf"{re.escape(name)}\b", text), (command, name)


@pytest.mark.parametrize("command", RUN_COMMANDS)
def test_stated_defaults_are_the_configurations(command):
    defaults = RunConfig.defaults()
    for param in _params(command):
        key = "prune" if param.name == "prune_n" else param.name
        if key not in defaults or param.default is None or param.is_flag is False and \
                param.default == ():
            continue
        shown = param.default.value if isinstance(param.default, Enum) else param.default
        assert shown == defaults[key], (command, param.name, shown, defaults[key])


@pytest.mark.parametrize("command", COMMANDS)
def test_no_option_states_two_defaults(command):
    for param in _params(command):
        if getattr(param, "show_default", None) is False or param.default in (None, ()):
            continue
        if isinstance(param.default, bool) and getattr(param, "secondary_opts", None) == []:
            continue  # a plain flag shows no default
        assert "default" not in (param.help or "").lower(), (command, param.name, param.help)


def test_help_texts_true_to_the_code():
    prune, score = _help("prune"), _help("score")
    assert re.search(r"lsq refits each layer's output\s+and MLP down\s+projections", prune)
    seed = next(p for p in _params("detect") if p.name == "seed")
    assert "split" not in seed.help and "repeated tokens" in seed.help
    out = next(p for p in _params("score") if p.name == "out")
    assert "score" in out.help
    calib = next(p for p in _params("score") if p.name == "calib_data")
    assert "recover" not in calib.help
    assert "recovery" in next(p for p in _params("prune") if p.name == "calib_data").help
    assert "--out" in score and "--calib-data" in score


def test_list_tasks_needs_no_model():
    r = CliRunner().invoke(app, ["eval", "--list-tasks"])
    assert r.exit_code == 0, r.output
    assert len(r.output.splitlines()) > 10


def test_one_warning_format_at_every_verbosity(capsys):
    from headlab.data.texts import BUNDLED_WARNING

    lines = []
    for quiet in (False, True):
        setup(quiet, False)
        logging.getLogger("headlab.runs.inputs").warning(BUNDLED_WARNING)
        lines.append(capsys.readouterr().err.strip())
    assert lines[0] == lines[1] == f"warning: {BUNDLED_WARNING}"
    assert "--data" not in BUNDLED_WARNING.split("(")[0]  # headlab run names `data`
    assert "data in a recipe" in BUNDLED_WARNING


def _summary(**over) -> dict:
    base = {"run_dir": "r", "model": "m", "method": "michel", "metric": "perplexity",
            "quality_before": 20.0, "quality_after": None, "quality_pruned": None,
            "recovery": None, "heads_total": 72, "heads_kept": None, "params_before": 10**7,
            "params_after": None, "latency_ms_before": None, "latency_ms_after": None,
            "report": "r/report.html", "results": "r/results.json", "model_dir": None,
            "scores": "r/importance.csv", "top_heads": [[3, 7, 0.45], [2, 6, 0.44]],
            "heads_per_layer": [[6] * 12, None], "kv_heads_per_layer": [[6] * 12, None],
            "kv_cache_bytes_per_token": [None, None], "compared": {}}
    return {**base, **over}


def test_score_prints_top_heads_and_where_the_scores_are(capsys):
    from headlab.cli.common import print_summary

    print_summary(_summary(), json_mode=False, quiet=False)
    out = capsys.readouterr().out
    assert "top heads: L3H7 0.45, L2H6 0.44" in out and "scores:  r/importance.csv" in out
    assert "after" not in out and "latency" not in out  # nothing a score run measures


def test_latency_in_human_units(capsys):
    from headlab._util.units import human_bytes, human_ms
    from headlab.cli.common import print_summary

    assert [human_bytes(v) for v in (640, 999.6, 9200, 999_600, 2.5e9)] == [
        "640 B", "1 KB", "9.2 KB", "1 MB", "2.5 GB"]
    assert [human_ms(v) for v in (12.34, 26060.0, 180_000.0)] == ["12.3 ms", "26.1 s", "3 min"]
    # where a value rounds to the next unit it is written in that unit, never as 1e+03
    assert [human_ms(v) for v in (999.7, 59_990.0)] == ["1 s", "1 min"]
    print_summary(_summary(heads_kept=36, params_after=5 * 10**6, quality_after=25.0,
                           latency_ms_before=26060.0, latency_ms_after=850.0),
                  json_mode=False, quiet=False)
    out = capsys.readouterr().out
    assert "26.1 s" in out and "850 ms" in out and "e+0" not in out


def test_kv_group_summary_shows_heads_per_layer_the_cache_and_the_compared_methods(
        capsys, tmp_path):
    from _report_fixture import make_results

    from headlab.cli.common import print_summary, summary
    from headlab.results import RunResult

    d = make_results(layers=30, heads=9)
    d.update(heads_kept=180, kv_heads_per_layer={"before": [3] * 30, "after": [2] * 30},
             heads_per_layer={"before": [9] * 30, "after": [6] * 30},
             kv_cache_bytes_per_token={"before": 46080, "after": 30720})
    d["curves"]["random"][-1]["quality"] = 88.5
    s = summary(RunResult.from_json(d), tmp_path)
    assert s["compared"]["random"] == 88.5 and set(s["compared"]) == {"ablation", "random"}
    print_summary(s, json_mode=False, quiet=False)
    out = capsys.readouterr().out
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
            for line in out.splitlines() if line.count("│") >= 3}
    assert rows["per layer"] == ["9 x 30 layers", "6 x 30 layers"]
    assert rows["key/value heads per layer"] == ["3 x 30 layers", "2 x 30 layers"]
    assert rows["key/value cache per token"] == ["46.1 KB", "30.7 KB"]
    assert rows["random choosing instead"] == ["", "88.5"]

    d.update(kind="embedding")  # an encoder keeps no cache: no row
    print_summary(summary(RunResult.from_json(d), tmp_path), json_mode=False, quiet=False)
    assert "cache" not in capsys.readouterr().out
