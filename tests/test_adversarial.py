"""The adversarial suite: what a hostile (or careless) user hands headlab, and the one
line each attempt must end in.

A contributor adding an option adds its hostile values here: the CLI table `CASES`
(a command line and the words its one-line refusal must hold, refused before the model
loads and leaving no run directory) and the API table `API_CASES` (a call and the
ValueError/TypeError naming the argument). The sections below cover what a table cannot:
task code that must not run, inputs that must not change, a resume that must not
continue another run, and a results.json that must not be trusted blindly.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch
from _cli import assert_one_line, cli

from headlab.data.texts import bundled_text


# ---------------------------------------------------------------- task code
def _code_task(folder: Path, marker: Path, *, tag: str = "!function evil.docs") -> Path:
    """A local lm-eval task whose YAML imports evil.py (which leaves ``marker``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "evil.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).write_text('ran')\n"
        "def docs(dataset):\n    return dataset\n")
    data = folder / "evil.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": ["yes", "no"], "label": 0})
                            + "\n" for q in ("Is it on?", "Is it off?")))
    (folder / "evil_task.yaml").write_text(
        "task: evil_task\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        f"process_docs: {tag}\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_target: label\n"
        "doc_to_choice: choices\n"
        "metric_list:\n  - metric: acc\n")
    return folder


def _imported_from(folder: Path) -> list[str]:
    return [name for name, m in list(sys.modules.items())
            if str(folder) in str(getattr(m, "__file__", "") or "")]


def test_task_code_is_refused_without_the_flag_and_nothing_is_imported(
        capsys, tmp_path, tiny_gpt2_dir):
    marker = tmp_path / "ran"
    folder = _code_task(tmp_path / "tasks", marker)
    yaml_file = folder / "evil_task.yaml"
    base = ["--tasks", "evil_task", "--include-path", str(folder)]
    for args in (["eval", "-m", str(tiny_gpt2_dir), *base],
                 ["eval", "-m", str(tiny_gpt2_dir), "--list-tasks", *base[2:]],
                 ["score", "-m", str(tiny_gpt2_dir), *base, "--out", str(tmp_path / "run")]):
        code, _, err = cli(capsys, *args)
        assert_one_line(code, err, f"task YAML {yaml_file.resolve()} would run Python code")
        assert "--trust-task-code" in err
        assert not marker.exists() and _imported_from(folder) == []
    assert not (tmp_path / "run").exists()
    code, out, err = cli(capsys, "eval", "-m", str(tiny_gpt2_dir), *base, "--limit", "2",
                         "--trust-task-code", "--max-tokens", "256", "--seq-len", "32")
    assert code == 0, err
    assert marker.read_text() == "ran" and "evil_task" in out


@pytest.mark.parametrize("yaml_text", [
    "class: !function evil.Task\n",
    "process_docs: !!python/name:os.system\n",
    "dataset_kwargs:\n  trust_remote_code: true\n",
    "doc_to_text: \"{{ cycler.__init__.__globals__.os.popen('id').read() }}\"\n",
    "doc_to_text: \"{{ (x|attr('__class__')) }}\"\n",
    "include: ../lib/o.yaml\n",  # outside the folder, but what lm-eval would load
])
def test_every_way_a_task_yaml_runs_code_is_refused(tmp_path, yaml_text):
    from headlab.errors import UserError
    from headlab.evaluate.task_code import check_task_code

    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "o.yaml").write_text("process_docs: !function evil.docs\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text("task: t\n" + yaml_text)
    with pytest.raises(UserError, match="would run Python code.*--trust-task-code"):
        check_task_code(tmp_path / "tasks", trust=False)
    check_task_code(tmp_path / "tasks", trust=True)


def test_plain_task_yamls_and_lm_evals_own_includes_pass(tmp_path):
    """A template's ordinary Jinja and an include of lm-eval's own task (which holds
    !function) are no task code of the user's."""
    import lm_eval

    from headlab.evaluate.task_code import check_task_code

    own = Path(lm_eval.__file__).parent / "tasks" / "ifeval" / "ifeval.yaml"
    assert "!function" in own.read_text()
    (tmp_path / "t.yaml").write_text(
        f"task: t\ninclude: {own}\n"
        "doc_to_text: \"{{text.split(' ')[:-1]|join(' ')}} ____. ->\"\n"
        "doc_to_target: \"{{['__a', '__b'].index(target)}}\"\n")
    check_task_code(tmp_path, trust=False)


def test_a_recipe_cannot_trust_its_own_task_code(capsys, tmp_path, tiny_gpt2_dir):
    marker = tmp_path / "ran"
    folder = _code_task(tmp_path / "tasks", marker)
    recipe = tmp_path / "r.toml"
    recipe.write_text(f'model = "{tiny_gpt2_dir}"\ncommand = "score"\ntasks = ["evil_task"]\n'
                      f'include_path = "{folder}"\nout = "{tmp_path / "run"}"\n')
    code, _, err = cli(capsys, "run", str(recipe))
    assert_one_line(code, err, "would run Python code")
    recipe.write_text(recipe.read_text() + "trust_task_code = true\n")
    code, _, err = cli(capsys, "run", str(recipe))
    assert_one_line(code, err, f"recipe {recipe} sets trust_task_code")
    assert not marker.exists() and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- inputs stay untouched
def _snapshot(*roots: Path) -> dict[str, str]:
    """Every file's bytes (as a hash) under ``roots``."""
    files = [p for r in roots for p in ([r] if r.is_file() else sorted(r.rglob("*")))]
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files if p.is_file()}


@pytest.fixture()
def inputs(tmp_path, tiny_gpt2_dir):
    """A model directory, a data file and a recipe, each in its own folder."""
    model = tmp_path / "models" / "m"
    shutil.copytree(tiny_gpt2_dir, model)
    data = tmp_path / "data" / "text.txt"
    data.parent.mkdir()
    data.write_text(bundled_text()[:20_000])
    recipe = tmp_path / "recipes" / "mine" / "r.toml"
    recipe.parent.mkdir(parents=True)
    return {"model": model, "data": data, "recipe": recipe, "root": tmp_path}


_QUICK = ["--keep", "0.5", "--method", "random", "--schedule", "one-shot", "--recover",
          "none", "--max-tokens", "512", "--seq-len", "32", "-q"]

# --out against an input: (the --out, extra options, the relation the line names)
OUT_CASES = [
    ("{model}", [], "is --model"),
    ("{model}/run", [], "lies inside --model"),
    ("{root}/models", [], "contains --model"),
    ("{data}.d", ["--data", "{data}"], None),  # beside the data: allowed, for contrast
    ("{root}/data", ["--data", "{data}"], "contains --data"),
    ("{root}/data", ["--calib-data", "{data}"], "contains --calib-data"),
    ("{root}/data", ["--eval-data", "{data}"], "contains --eval-data"),
    ("{root}", ["--data", "{data}"], "contains --model"),
]


@pytest.mark.parametrize("overwrite", [False, True], ids=["", "overwrite"])
@pytest.mark.parametrize(("out", "extra", "relation"), OUT_CASES,
                         ids=[f"{o} {' '.join(e)}" for o, e, _ in OUT_CASES])
def test_out_never_overlaps_an_input(capsys, inputs, out, extra, relation, overwrite):
    names = {k: str(v) for k, v in inputs.items()}
    before = _snapshot(inputs["model"], inputs["data"])
    args = ["prune", "-m", names["model"], "--out", out.format(**names),
            *(e.format(**names) for e in extra), *_QUICK]
    if relation is None:  # the contrast: a run beside its inputs completes
        code, _, err = cli(capsys, *args)
        assert code == 0, err
    else:
        code, _, err = cli(capsys, *args, *(["--overwrite"] if overwrite else []))
        assert_one_line(code, err, relation)
        assert "must not write over its inputs" in err
    assert _snapshot(inputs["model"], inputs["data"]) == before


def test_a_recipe_never_writes_into_its_own_folder(capsys, inputs):
    recipe = inputs["recipe"]
    for out in (recipe.parent, recipe.parent.parent):
        recipe.write_text(f'model = "{inputs["model"]}"\nkeep = 0.5\nout = "{out}"\n'
                          "overwrite = true\n")
        before = _snapshot(recipe)
        code, _, err = cli(capsys, "run", str(recipe))
        assert_one_line(code, err, "the recipe")
        assert _snapshot(recipe) == before


def test_an_empty_out_is_refused(capsys, tmp_path, tiny_gpt2_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "prune", "-m", str(tiny_gpt2_dir), "--out", "", *_QUICK)
    assert_one_line(code, err, "--out '' names no directory")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("command", "words"), [
    ("prune", "(twice: a prune keeps the pruned copy beside it)"), ("score", "in float32")])
def test_weights_larger_than_the_memory_are_refused_before_loading(
        capsys, tmp_path, tiny_gpt2_dir, monkeypatch, command, words):
    """A model whose weights (counted from the safetensors header) cannot fit the
    device's memory is refused in one line before a byte of them is read."""
    from headlab.models import loading
    from headlab.runs import preflight

    monkeypatch.setattr(preflight, "available", lambda device: 1000)  # bytes
    monkeypatch.setattr(loading, "read_weights", lambda *a: pytest.fail("weights read"))
    out = tmp_path / "r"
    options = _QUICK if command == "prune" else ["--method", "random", "-q"]
    code, _, err = cli(capsys, command, "-m", str(tiny_gpt2_dir), "--out", str(out), *options)
    assert_one_line(code, err, "parameters need")
    assert words in err and "more than the 0.0 GiB cpu can give" in err
    assert not out.exists()


# ---------------------------------------------------------------- resume is the same run
def _score_args(model: Path, data: Path, out: Path) -> list[str]:
    return ["score", "-m", str(model), "--data", str(data), "--max-tokens", "2048",
            "--seq-len", "32", "--batch-size", "2", "--out", str(out), "-q"]


def _interrupted(capsys, monkeypatch, args: list[str]) -> None:
    """Run ``args``, stopped (as by Ctrl-C) right after scoring's first checkpoint."""
    from headlab._util import checkpoint as ck

    real, puts = ck.Checkpoint.put, []

    def put(self, key, state):
        real(self, key, state)
        puts.append(key)
        if len(puts) == 1:
            raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(ck.Checkpoint, "put", put)
        code, _, err = cli(capsys, *args)
    assert code == 130 and puts == ["score", "score"], err


def _edit_config(out: Path, **keys) -> None:
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **keys}))


@pytest.fixture()
def resumable(capsys, monkeypatch, tmp_path, tiny_gpt2_dir):
    model = tmp_path / "m"
    shutil.copytree(tiny_gpt2_dir, model)
    data = tmp_path / "text.txt"
    data.write_text(bundled_text()[:30_000])
    out = tmp_path / "cut"
    _interrupted(capsys, monkeypatch, _score_args(model, data, out))
    return {"model": model, "data": data, "out": out, "tmp": tmp_path}


def test_an_unedited_resume_gives_the_uninterrupted_scores(capsys, resumable):
    r = resumable
    full = r["tmp"] / "full"
    code, _, err = cli(capsys, *_score_args(r["model"], r["data"], full))
    assert code == 0, err
    code, _, err = cli(capsys, "score", "--resume", str(r["out"]), "-q")
    assert code == 0, err
    a, b = (json.loads((d / "results.json").read_text()) for d in (full, r["out"]))
    assert a["importance"] == b["importance"]


# an edit to the run (its config.json or its inputs) and the key the refusal names
EDITS = {
    "another model": ("model", lambda r: _edit_config(r["out"], model=str(r["tmp"] / "m2"))),
    "the model's config": ("model_files", lambda r: (r["model"] / "config.json").write_text(
        (r["model"] / "config.json").read_text().replace("{", '{"edited": 1, ', 1))),
    "another method": ("method", lambda r: _edit_config(r["out"], method="fisher")),
    "another seed": ("seed", lambda r: _edit_config(r["out"], seed=1)),
    "another seq_len": ("seq_len", lambda r: _edit_config(r["out"], seq_len=64)),
    "the data's text": ("tokens", lambda r: r["data"].write_text(bundled_text()[5_000:35_000])),
}


@pytest.mark.parametrize("edit", sorted(EDITS))
def test_a_resume_of_an_edited_run_is_refused_naming_the_key(capsys, resumable, edit):
    r = resumable
    shutil.copytree(r["model"], r["tmp"] / "m2")
    key, change = EDITS[edit]
    change(r)
    code, _, err = cli(capsys, "score", "--resume", str(r["out"]), "-q")
    assert_one_line(code, err, f"belongs to another run: {key} was")
    assert not (r["out"] / "results.json").exists()
    assert json.loads((r["out"] / "status.json").read_text())["status"] == "interrupted"


# ---------------------------------------------------------------- refused before loading
@pytest.fixture(scope="module")
def hostile(tmp_path_factory, tiny_gpt2_dir):
    """Models, data and recipes a hostile user would hand over (the tiny GPT-2 has
    3 layers x 4 heads, E=32, 128 positions)."""
    d = tmp_path_factory.mktemp("hostile")
    files = {}

    def model_with(name: str, **keys) -> None:
        path = d / name
        shutil.copytree(tiny_gpt2_dir, path)
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **keys}))
        files[name] = path

    model_with("heads0", n_head=0)
    model_with("heads_text", n_head="4")
    model_with("layers_negative", n_layer=-1)
    model_with("indivisible", n_embd=30)
    deep = "[" * 100_000 + "]" * 100_000
    path = d / "deepconfig"
    shutil.copytree(tiny_gpt2_dir, path)
    (path / "config.json").write_text('{"model_type": "gpt2", "x": ' + deep + "}")
    files["deepconfig"] = path
    (d / "deep.jsonl").write_text('{"text": ' + deep + "}\n")
    files["deep_jsonl"] = d / "deep.jsonl"
    (d / "deep.json").write_text(deep)
    files["deep_json"] = d / "deep.json"
    (d / "binary.toml").write_bytes(b'model = "minilm-l6"\nkeep = 0.5\n# \xff\n')
    files["binary_recipe"] = d / "binary.toml"
    (d / "needle.toml").write_text(f'model = "{tiny_gpt2_dir}"\ncommand = "score"\n'
                                   'tasks = ["needle"]\nneedle_lengths = 512\n')
    files["needle_recipe"] = d / "needle.toml"
    (d / "a-file").write_text("not a folder")
    files["afile"] = d / "a-file"
    model_with("unsupported", model_type="mamba")
    model_with("huge", n_embd=65536)
    for name, keep in (("notok", ()), ("badtok", ("tokenizer_config.json",)),
                       ("smalltok", ())):
        path = d / name
        path.mkdir()
        for f in ("config.json", "model.safetensors", *keep):
            shutil.copy(tiny_gpt2_dir / f, path / f)
        files[name] = path
    (d / "badtok" / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    _small_tokenizer(d / "smalltok")
    files["encoder"] = _encoder_dir(d / "encoder")
    return files


def _small_tokenizer(path: Path) -> None:
    """A word-level tokenizer of 20 words (21 tokens once transformers adds GPT-2's
    end of text), for a model with 512 embeddings."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["[UNK]", "the", "a", "of", "and", "to", "in", "is", "was", "it", "that", "for",
             "on", "as", "with", "by", "at", "an", "be", "or"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))


def _encoder_dir(path: Path) -> Path:
    """A tiny random BertModel (an embedding model: 2 layers x 4 heads) with WordPiece."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    path.mkdir()
    words = ["the", "a", "cat", "dog", "sat", "on", "mat", "and", "it", "was", "."]
    (path / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
                                               *words]) + "\n")
    tok = Tokenizer(models.WordPiece.from_file(str(path / "vocab.txt"), unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
        unk_token="[UNK]", mask_token="[MASK]").save_pretrained(path)
    cfg = transformers.BertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64,
                                  max_position_embeddings=64)
    transformers.BertModel(cfg).eval().save_pretrained(path)
    return path


# (command line, what the one line must name); {model} is the tiny GPT-2, {out} a run
# directory that must not exist afterwards, other names come from `hostile`
CASES = [
    ("prune -m {heads0} --keep 0.5 --out {out}", "n_head must be a whole number >= 1, got 0"),
    ("prune -m {heads_text} --keep 0.5 --out {out}", "n_head must be a whole number >= 1"),
    ("score -m {layers_negative} --out {out}", "n_layer must be a whole number >= 1, got -1"),
    ("score -m {indivisible} --out {out}", "hidden size 30 is not divisible by the 4"),
    ("eval -m {heads0}", "n_head must be a whole number"),
    ("eval -m {deepconfig}", "nests deeper"),
    ("score -m {model} --data {deep_jsonl} --out {out}", "deep.jsonl line 1: it nests deeper"),
    ("score -m {model} --data {deep_json} --out {out}", "deep.json: it nests deeper"),
    ("run {binary_recipe}", "is not UTF-8 text (byte"),
    ("run {needle_recipe}", "needle_lengths must be"),
    ("prune -m {model} --keep 0.5 --min-heads-per-layer 5 --out {out}",
     "--min-heads-per-layer 5 is more than the 4 heads"),
    ("prune -m {model} --keep 0.5 --eval-protocol windows --eval-seq-len 256 --out {out}",
     "--eval-seq-len 256 is beyond the 128 positions"),
    ("prune -m {model} --keep 0.5 --calib-samples 4 --calib-seq-len 200 --out {out}",
     "--calib-seq-len 200 is beyond the 128 positions"),
    ("score -m {model} --tasks needle --needle-lengths 256 --out {out}",
     "--needle-lengths 256 is beyond the 128 positions"),
    ("eval -m {model} --tasks needle --needle-lengths 256", "--needle-lengths 256 is beyond"),
    ("prune -m {model} --keep 0.5 --tasks needle --needle-lengths abc --out {out}",
     "--needle-lengths takes token counts"),
    ("prune -m {model} --keep 0.5 --seed 9223372036854775808 --out {out}",
     "--seed must be in [0, 2**63 - 1]"),
    ("prune -m {model} --keep 0.5 --seed -1 --out {out}", "--seed must be in"),
    ("prune -m {model} --keep 0.5 --recover-ridge 1e308 --out {out}",
     "--recover-ridge must be in [0, 1e+06]"),
    ("prune -m {model} --keep 0.5 --recover-ridge inf --out {out}", "recover_ridge"),
    ("prune -m {model} --keep 0.5 --recover lsq --recover-tokens 100 --out {out}",
     "--recover-tokens shape distill, which --recover lsq does not run"),
    ("prune -m {model} --keep 0.5 --recover bias --recover-params all --out {out}",
     "--recover-params shape distill, which --recover bias does not run"),
    ("prune -m {model} --keep 0.5 --recover distill --recover-lr 1e30 --out {out}",
     "--recover-lr must be in (0, 1]"),
    ("prune -m {model} --keep 0.5 --shard fsdp --out {out}", "start it with torchrun"),
    ("eval -m {model} --shard fsdp", "start it with torchrun"),
    ("eval -m {model} --tasks nope_task_xyz", "unknown lm-eval task(s) nope_task_xyz"),
    ("prune -m {model} --keep 0.5 --tasks nope_task_xyz --out {out}", "nope_task_xyz"),
    ("detect -m {model} --n 0", "'--n'"),
    ("detect -m {model} --top -1", "'--top'"),
    ("detect -m {model} --kinds nonsense", "unknown detector(s) nonsense"),
    ("detect -m {model} --out {afile}/x.json", "is a file, not a folder"),
    ("inspect {model} hello --top -1", "'--top'"),
    ("inspect {model} hello --html {afile}/x.html", "is a file, not a folder"),
    ("validate -m {model} --n-boot 0", "'--n-boot'"),
    ("prune -m {encoder} --keep 0.5 --unit kv-group --demote --out {out}",
     "--demote keeps the first and the last positions of a causal model's past"),
    ("prune -m {encoder} --unit kv-group --kv-keep 0.5 --demote --demote-by gates "
     "--out {out}", "--demote keeps the first and the last positions of a causal model's past"),
    ("prune -m {model} --unit kv-group --kv-keep 0.5 --demote-by gates --out {out}",
     "--demote-by chooses the groups --demote demotes: add --demote"),
    ("prune -m {model} --unit kv-group --kv-keep 0.5 --demote --demote-by gates --gate-reg -1 "
     "--out {out}", "--gate-reg must be a finite weight >= 0"),
    ("prune -m {encoder} --keep 0.5 --tasks needle --out {out}",
     "--tasks needle asks a causal language model"),
    ("eval -m {encoder} --tasks needle", "--tasks needle asks a causal language model"),
    ("score -m {unsupported} --out {out}", "architecture 'mamba' is not supported"),
    ("eval -m {unsupported}", "architecture 'mamba' is not supported"),
    ("score -m {huge} --out {out}", "3 layers of hidden size 65536 need at least"),
    ("score -m {notok} --out {out}", "has no tokenizer files"),
    ("prune -m {badtok} --keep 0.5 --out {out}", "tokenizer.json cannot be read"),
    ("score -m {smalltok} --out {out}",
     "the tokenizer holds 21 tokens for the model's 512 embedding rows"),
]


@pytest.mark.parametrize(("command", "culprit"), CASES, ids=[c for c, _ in CASES])
def test_hostile_options_are_refused_in_one_line_before_loading(
        capsys, monkeypatch, tmp_path, hostile, tiny_gpt2_dir, command, culprit):
    import headlab.runs.pipeline

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the refusal")

    for module in ("headlab.runs.pipeline", "headlab.runs.evaluate", "headlab.runs.inputs"):
        monkeypatch.setattr(f"{module}.load_model", loaded)
    monkeypatch.setattr("headlab.models.load", loaded)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert headlab.runs.pipeline.load_model is loaded
    names = {k: str(v) for k, v in hostile.items()} | {"model": str(tiny_gpt2_dir),
                                                       "out": str(tmp_path / "run")}
    start = time.perf_counter()
    code, _, err = cli(capsys, *command.format(**names).split())
    assert_one_line(code, err, culprit.format(**names))
    assert not (tmp_path / "run").exists()
    assert time.perf_counter() - start < 60


# ---------------------------------------------------------------- results.json read back
_RESULTS = {"model": "m", "method": "michel", "heads_total": 2, "importance": [[0.1, 0.2]]}


@pytest.mark.parametrize(("edit", "culprit"), [
    ({"schema_version": 99}, "results['schema_version'] is 99; this headlab reads versions 1 "
                             "to 2"),
    ({"schema_version": "2"}, "results['schema_version'] is '2'"),
    ({"importance": [["0.1", "0.2"]]}, "results['importance'] layer 0 holds '0.1'"),
    ({"heads_total": "2"}, "results['heads_total'] must be a whole number"),
    ("deep", "nests deeper"),
])
def test_report_refuses_results_it_cannot_read_naming_the_key(capsys, tmp_path, edit,
                                                              culprit):
    run = tmp_path / "run"
    run.mkdir()
    text = ('{"x": ' + "[" * 200_000 + "]" * 200_000 + "}" if edit == "deep"
            else json.dumps({**_RESULTS, **edit}))
    (run / "results.json").write_text(text)
    code, _, err = cli(capsys, "report", str(run))
    assert_one_line(code, err, culprit)
    assert not (run / "report.html").exists()


# ---------------------------------------------------------------- the Python API
@pytest.fixture(scope="module")
def api(tmp_path_factory, tiny_gpt2_dir):
    """A tiny GPT-2 with blocks and scores, and a tiny embedding model (a BertModel
    with a WordPiece vocabulary) with its blocks, unprepared."""
    import headlab

    path = _encoder_dir(tmp_path_factory.mktemp("api") / "embedding")
    model, bert = headlab.load(tiny_gpt2_dir), headlab.load(path)
    texts = headlab.load_texts()
    return {
        "path": tiny_gpt2_dir, "model": model, "texts": texts, "bert": bert,
        "blocks": headlab.make_blocks(texts, model.tokenizer, kind=model.kind, seq_len=32,
                                      max_tokens=512),
        "bert_blocks": headlab.make_blocks(texts, bert.tokenizer, kind=bert.kind,
                                           seq_len=32, max_tokens=256),
        "scores": headlab.HeadScores([[0.1, 0.2, 0.3, 0.4]] * 3, "michel"),
    }


def _blocks(a, **kwargs):
    import headlab

    return headlab.make_blocks(a["texts"], a["model"].tokenizer, kind="causal-lm",
                               **{"seq_len": 32, **kwargs})


def _pruned(a, plan):
    import headlab

    return headlab.prune(headlab.pruning.copy_model(a["model"]), plan)


def _captured_layers(a, layers):
    import headlab

    with headlab.capture(a["model"], "pattern", layers=layers):
        pass


# (the call, the error, the words its message must hold); `a` is the `api` fixture
API_CASES = [
    ("select([[0.1, 0.2]], 2)", lambda h, a: h.select([[0.1, 0.2]], 2),
     TypeError, "scores must be a HeadScores"),
    ("select(None, 2)", lambda h, a: h.select(None, 2), TypeError, "scores must be a HeadScores"),
    ("select(scores, 2.5)", lambda h, a: h.select(a["scores"], 2.5),
     TypeError, "n_keep must be a whole number (int), got 2.5"),
    ("select(scores, 4, min_heads_per_layer=-1)",
     lambda h, a: h.select(a["scores"], 4, min_heads_per_layer=-1),
     ValueError, "min_heads_per_layer must be at least 0, got -1"),
    ("prune(model, {0: [0]})", lambda h, a: _pruned(a, {0: [0]}),
     TypeError, "plan must be a PrunePlan"),
    ("prune(model, PrunePlan(kept={0: [99]}))",
     lambda h, a: _pruned(a, h.PrunePlan(kept={0: [99]}, pruned={})),
     ValueError, "plan: layer 0 keeps head 99, but the model's layers have heads 0..3"),
    ("prune(model, PrunePlan(pruned={7: [0]}))",
     lambda h, a: _pruned(a, h.PrunePlan(kept={}, pruned={7: [0]})),
     ValueError, "plan: layer 7 is beyond the model's 3 layers"),
    ("heads_to_keep(10, prune=2.5)", lambda h, a: h.heads_to_keep(10, prune=2.5),
     TypeError, "prune must be a whole number (int), got 2.5"),
    ("heads_to_keep(10, keep='0.5')", lambda h, a: h.heads_to_keep(10, keep="0.5"),
     TypeError, "keep must be a number, got '0.5'"),
    ("make_blocks(..., seq_len=32.0)", lambda h, a: _blocks(a, seq_len=32.0),
     TypeError, "seq_len must be a whole number (int), got 32.0"),
    ("make_blocks(..., max_tokens=-100)", lambda h, a: _blocks(a, max_tokens=-100),
     ValueError, "max_tokens must be at least 1, got -100"),
    ("evaluate(model, heldout, batch_size=0)",
     lambda h, a: h.evaluate(a["model"], a["blocks"], batch_size=0),
     ValueError, "batch_size must be at least 1, got 0"),
    ("evaluate(model, heldout, batch_size=-1)",
     lambda h, a: h.evaluate(a["model"], a["blocks"], batch_size=-1),
     ValueError, "batch_size must be at least 1, got -1"),
    ("score(model, blocks, batch_size=-1)",
     lambda h, a: h.score(a["model"], a["blocks"], batch_size=-1),
     ValueError, "batch_size must be at least 1, got -1"),
    ("score(embedding model, unprepared blocks)",
     lambda h, a: h.score(a["bert"], a["bert_blocks"]),
     ValueError, "score: blocks lack the reference embeddings"),
    ("detect(model, 'induction', n=0)", lambda h, a: h.detect(a["model"], "induction", n=0),
     ValueError, "n must be at least 1, got 0"),
    ("load('')", lambda h, a: h.load(""), ValueError, "name_or_path is empty"),
    ("load(path, device='nope')", lambda h, a: h.load(a["path"], device="nope"),
     ValueError, "device 'nope' is no torch device"),
    ("PrunePlan.from_json({})", lambda h, a: h.PrunePlan.from_json({}),
     ValueError, "a plan's JSON needs 'kept' and 'pruned'"),
    ("HeadScores.from_json({'scores': 'abc'})",
     lambda h, a: h.HeadScores.from_json({"scores": "abc"}),
     TypeError, "scores must be a list of rows (one per layer) of numbers or None"),
    ("split_blocks(blocks, seed=2**70)", lambda h, a: h.split_blocks(a["blocks"], seed=2**70),
     ValueError, "seed must be in [0, 2**63 - 1]"),
    ("capture(model, 'pattern', layers=[99])", lambda h, a: _captured_layers(a, [99]),
     ValueError, "layers [99] are beyond the model's 3 layers"),
]


@pytest.mark.parametrize(("call", "error", "words"), [(f, e, w) for _, f, e, w in API_CASES],
                         ids=[c for c, *_ in API_CASES])
def test_the_api_refuses_bad_arguments_naming_them(monkeypatch, tmp_path, api, call, error,
                                                   words):
    import re

    import headlab

    monkeypatch.chdir(tmp_path)
    shutil.copytree(api["path"], tmp_path, dirs_exist_ok=True)  # load('') would take it
    with pytest.raises(error, match=re.escape(words)):
        call(headlab, api)


def test_a_report_error_names_report_html_not_its_temporary_file(capsys, tmp_path):
    run = tmp_path / "run"
    (run / "report.html").mkdir(parents=True)  # in the way of the rename
    (run / "results.json").write_text(json.dumps(_RESULTS))
    code, _, err = cli(capsys, "report", str(run))
    assert_one_line(code, err, str(run / "report.html"))
    assert ".tmp" not in err
    assert sorted(p.name for p in run.iterdir()) == ["report.html", "results.json"]


# ---------------------------------------------------------------- weights read as they are
def test_integer_weights_without_scales_are_refused(capsys, tmp_path, tiny_gpt2_dir):
    from safetensors.torch import load_file, save_file

    model = tmp_path / "int8"
    shutil.copytree(tiny_gpt2_dir, model)
    state = load_file(model / "model.safetensors")
    key = "transformer.h.0.attn.c_attn.weight"
    state[key] = (state[key] * 100).to(torch.int8)
    save_file(state, model / "model.safetensors")
    code, _, err = cli(capsys, "eval", "-m", str(model))
    assert_one_line(code, err, key)
    assert "int8" in err and "no scales" in err


def test_inspect_refuses_a_text_beyond_the_positions_instead_of_cutting_it(
        capsys, tmp_path, tiny_gpt2_dir):
    text = " ".join(["the cat sat on the mat"] * 60)  # some 360 tokens; 128 positions
    code, _, err = cli(capsys, "inspect", str(tiny_gpt2_dir), text,
                       "--html", str(tmp_path / "v.html"))
    assert_one_line(code, err, "beyond the model's 128 positions")
    assert not (tmp_path / "v.html").exists()
