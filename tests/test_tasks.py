"""Tests for headlab.evaluate.lm_eval: lm-evaluation-harness on headlab's models.

Reference: lm-eval's own `HFLM` on the transformers model of the same checkpoint (a
random GPT-2 saved here; the bundled SmolLM2 through its GGUF, marked slow): per-request
log-likelihoods within 1e-4, the same greedy flags, rolling log-likelihoods and greedy
generations, and identical accuracy on a local multiple-choice task written here
(jsonl + task YAML). Errors: an unknown task says how to list the names; a task that
needs the hub while offline says so in one line.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from torch.testing import assert_close

import headlab
from headlab.errors import UserError
from headlab.evaluate.lm_eval import HeadlabLM, run_tasks

QUESTIONS = [
    ("The cat sat on the", ["mat", "sky", "river"], 0),
    ("A recipe needs flour, eggs and", ["sugar", "a hammer", "rain"], 0),
    ("The machine is switched off at the", ["wall", "moon", "start of the contract"], 0),
    ("She opened the door and", ["walked in", "blue", "seven"], 0),
    ("Two plus two is", ["four", "a cloud", "the tenant"], 0),
    ("The results of the study were", ["mixed", "under the bed", "eaten"], 1),
]


def write_mc_task(folder, name="headlab_mc"):
    """A local multiple-choice task: a jsonl of questions and lm-eval's task YAML."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "label": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: '{{question}}'\n"
        "doc_to_target: label\n"
        "doc_to_choice: choices\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return folder


def task_instances(folder, name="headlab_mc"):
    from lm_eval.tasks import TaskManager

    task = TaskManager(include_path=str(folder), include_defaults=False).load(
        [name])["tasks"][name]
    task.build_all_requests(rank=0, world_size=1)
    return task.instances


def hflm(hf_model, tokenizer):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=hf_model, tokenizer=tokenizer, batch_size=4, device="cpu")


def check_against_hflm(model, reference, folder):
    """Per-request log-likelihoods and greedy flags, rolling log-likelihoods and greedy
    generations of the adapter against HFLM; then the task's accuracy."""
    from lm_eval.api.instance import Instance

    ours = HeadlabLM(model, batch_size=3)
    instances = task_instances(folder)
    got, want = ours.loglikelihood(instances), reference.loglikelihood(instances)
    assert len(got) == len(instances) == 3 * len(QUESTIONS)
    assert_close(torch.tensor([g[0] for g in got], dtype=torch.float64),
                 torch.tensor([w[0] for w in want], dtype=torch.float64), rtol=0, atol=1e-4)
    assert [g[1] for g in got] == [w[1] for w in want]

    texts = [q + " " + c[0] + "." for q, c, _ in QUESTIONS]
    rolling = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert_close(torch.tensor(ours.loglikelihood_rolling(rolling), dtype=torch.float64),
                 torch.tensor(reference.loglikelihood_rolling(rolling), dtype=torch.float64),
                 rtol=0, atol=1e-4)

    kwargs = {"until": ["\n"], "max_gen_toks": 6, "do_sample": False}
    prompts = [Instance("generate_until", {}, (q, dict(kwargs)), i)
               for i, (q, _, _) in enumerate(QUESTIONS[:4])]
    assert ours.generate_until(prompts) == reference.generate_until(prompts)

    import lm_eval
    from lm_eval.tasks import TaskManager

    theirs = lm_eval.simple_evaluate(
        model=reference, tasks=["headlab_mc"], log_samples=False, bootstrap_iters=1000,
        task_manager=TaskManager(include_path=str(folder), include_defaults=False))
    mine = run_tasks(model, ["headlab_mc"], include_path=folder, batch_size=3)
    assert mine["headlab_mc"]["acc,none"] == theirs["results"]["headlab_mc"]["acc,none"]
    assert mine == {k: dict(v) for k, v in theirs["results"].items()}


def test_adapter_equals_hflm_on_a_random_gpt2(tiny_gpt2, tiny_gpt2_dir, tmp_path):
    hf = transformers.GPT2LMHeadModel.from_pretrained(tiny_gpt2_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tiny_gpt2_dir)
    check_against_hflm(tiny_gpt2, hflm(hf, tok), write_mc_task(tmp_path / "tasks"))


@pytest.mark.slow
@pytest.mark.real
def test_adapter_equals_hflm_on_smollm2_through_its_gguf(tmp_path):
    from headlab.models.loading import bundled_path

    path = bundled_path("smollm2-135m")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    check_against_hflm(headlab.load("smollm2-135m"), hflm(hf, tok),
                       write_mc_task(tmp_path / "tasks"))


@pytest.mark.slow  # an unknown name is looked up in lm-eval's whole index (~30 s to build)
def test_unknown_task_says_how_to_list_names(tiny_gpt2, tmp_path):
    folder = write_mc_task(tmp_path / "tasks")
    with pytest.raises(UserError, match=r"unknown lm-eval task\(s\) no_such_task_xyz; list "
                                        r"the names with `headlab eval --model M --list-tasks`"):
        run_tasks(tiny_gpt2, ["no_such_task_xyz"], include_path=folder)


def test_a_task_that_needs_the_hub_says_so_offline(tiny_gpt2, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "hubtask.yaml").write_text(
        "task: hubtask\ndataset_path: someone/not-on-this-machine\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\n"
        "doc_to_choice: ['a', 'b']\nmetric_list:\n  - metric: acc\n")
    with pytest.raises(UserError, match="task hubtask needs its dataset someone/not-on-this-"
                                        "machine from the Hugging Face hub"):
        run_tasks(tiny_gpt2, ["hubtask"], include_path=folder)


def test_a_run_with_a_task_it_cannot_read_fails_before_it_starts(tiny_gpt2_dir, tmp_path,
                                                                 monkeypatch):
    from typer.testing import CliRunner

    from headlab.cli import app

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "hubtask2.yaml").write_text(
        "task: hubtask2\ndataset_path: someone/else-not-here\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_target: 0\n"
        "doc_to_choice: ['a', 'b']\nmetric_list:\n  - metric: acc\n")
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["score", "--model", str(tiny_gpt2_dir), "--method", "random",
                                   "--tasks", "hubtask2", "--include-path", str(folder),
                                   "--out", str(out), "--quiet"])
    assert res.exit_code == 2
    assert "error: task hubtask2 needs its dataset someone/else-not-here from the Hugging " \
           "Face hub" in res.output
    assert not out.exists()


@pytest.mark.slow  # a prune run, then lm-eval and the needle test twice: ~1 min
def test_prune_and_eval_report_tasks_and_needle_before_and_after(tiny_gpt2_dir, tmp_path):
    from typer.testing import CliRunner

    from headlab.cli import app
    from headlab.results import RunResult

    folder = write_mc_task(tmp_path / "tasks")
    out = tmp_path / "run"
    res = CliRunner().invoke(app, [
        "prune", "--model", str(tiny_gpt2_dir), "--keep", "0.5", "--schedule", "one-shot",
        "--recover", "none", "--max-tokens", "512", "--tasks", "headlab_mc,needle",
        "--include-path", str(folder), "--needle-lengths", "64", "--out", str(out), "--quiet"])
    assert res.exit_code == 0, res.output
    saved = json.loads((out / "results.json").read_text())
    mc = saved["tasks"]["headlab_mc"]
    assert set(mc) == {"before", "after"}
    for side in ("before", "after"):
        assert 0 <= mc[side]["acc,none"] <= 1 and "acc_stderr,none" in mc[side]
        assert saved["needle"][side]["lengths"] == [64]
    assert saved["versions"]["lm_eval"] == "0.4.13"
    assert RunResult.from_json(saved).to_json() == saved
    html = (out / "report.html").read_text()
    assert "Tasks and long-context retrieval" in html and 'class="figure needle"' in html
    assert html.count("acc,none") == 1

    res = CliRunner().invoke(app, [
        "eval", "--model", str(out / "model"), "--tasks", "headlab_mc", "--include-path",
        str(folder), "--max-tokens", "512", "--json"])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout)
    assert summary["tasks"]["headlab_mc"] == mc["after"]
