"""Distillation of a pruned model toward its unpruned original (headlab.recovery.distill),
on tiny random models built from headlab's own configs and random token blocks."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from headlab._util import progress as _progress
from headlab._util.checkpoint import Checkpoint
from headlab._util.kl import weighted_kl
from headlab.data.blocks import Blocks
from headlab.errors import UserError
from headlab.models.bert import Bert, BertConfig
from headlab.models.gpt2 import GPT2, GPT2Config
from headlab.models.llama import Llama, LlamaConfig
from headlab.objectives import objective_for
from headlab.pruning import prune
from headlab.recovery.distill import distill
from headlab.selection import PrunePlan

VOCAB = 64


def _gpt2() -> GPT2:
    torch.manual_seed(0)
    return GPT2(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=16, n_layer=2, n_head=4))


def _llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig.from_hf(dict(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)))


BUILDERS = {"gpt2": _gpt2, "llama": _llama}


def _pruned(reference):
    """A copy of ``reference`` with one head of each layer removed (a Llama GQA group
    keeps its other query head)."""
    plan = PrunePlan({0: [0, 1, 2], 1: [0, 2, 3]}, {0: [3], 1: [1]})
    return prune(reference, plan, inplace=False)


def _blocks(n: int = 12, seq: int = 16, *, seed: int = 0, labels=None) -> Blocks:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, seq), generator=gen)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[::3, seq - 5:] = 0  # some rows padded
    return Blocks(ids, mask, labels, spec="random")


def _mean_kl(pruned, reference, blocks) -> float:
    objective = objective_for(pruned)
    with torch.no_grad():
        batch = next(blocks.batches(len(blocks)))
        return float(objective.distill_loss(pruned, objective.forward(pruned, batch), reference,
                                            objective.forward(reference, batch), batch, 1.0))


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("temperature", [1.0, 2.5])
@pytest.mark.parametrize("scored", ["all", "runs", "scattered", "none"])
def test_chunked_kl_equals_torch_kl_div_in_float64(scored, temperature, monkeypatch):
    """The distillation loss's KL (`weighted_kl`, a few rows at a time) against torch's
    kl_div in float64: its value and its gradient in the student's logits, for logits
    sliced as a causal LM's are (a view, rows not contiguous), over every row, runs of
    rows (padding), scattered rows (masked LM) and none; chunks of 3 rows here."""
    monkeypatch.setattr("headlab._util.kl._CHUNK_VALUES", 3 * 50)
    gen = torch.Generator().manual_seed(0)
    student = (4 * torch.randn(3, 9, 50, generator=gen))[:, :-1]  # (B, T, V) a view
    teacher = 4 * torch.randn(3, 8, 50, generator=gen)
    weights = {"all": torch.ones(3, 8),
               "runs": (torch.arange(8) < torch.tensor([[8], [5], [2]])).float(),
               "scattered": (torch.rand(3, 8, generator=gen) < 0.3).float(),
               "none": torch.zeros(3, 8)}[scored]
    s64 = student.double().requires_grad_(True)
    log_s = F.log_softmax(s64 / temperature, -1)
    log_t = F.log_softmax(teacher.double() / temperature, -1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)  # (B, T)
    expected = (kl * weights.double()).sum() / weights.double().sum().clamp(min=1)
    (3 * expected).backward()
    s32 = student.clone().requires_grad_(True)
    ours = weighted_kl(s32, teacher, weights, temperature)
    (3 * ours).backward()
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), expected.detach(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(s32.grad.double(), s64.grad, rtol=1e-4, atol=1e-7)
    assert (s32.grad[weights == 0] == 0).all()


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_distillation_loss_goes_down_on_the_scoring_data(family):
    reference = BUILDERS[family]()
    pruned = _pruned(reference)
    blocks = _blocks()
    before = _mean_kl(pruned, reference, blocks)
    summary = distill(pruned, reference, blocks, params="attention", lr=3e-3, batch_size=4,
                      tokens=10 * blocks.n_tokens)
    after = _mean_kl(pruned, reference, blocks)
    assert before > 0
    assert after < 0.5 * before
    losses = summary["losses"]
    assert len(losses) == summary["steps"] == 30  # 10 passes of 3 batches
    assert sum(losses[-3:]) < 0.5 * sum(losses[:3])
    assert summary["loss_first"] == losses[0] and summary["loss_last"] == losses[-1]
    assert summary["tokens"] == 10 * blocks.n_tokens


def test_one_pass_by_default_and_the_budget_is_met_by_whole_batches():
    reference = _gpt2()
    blocks = _blocks()
    summary = distill(_pruned(reference), reference, blocks, batch_size=4, accumulate=2)
    assert summary["tokens"] == blocks.n_tokens
    assert summary["steps"] == 2  # 3 batches, 2 per step
    summary = distill(_pruned(reference), reference, blocks, batch_size=4, tokens=1)
    assert summary["steps"] == 1 and 0 < summary["tokens"] <= 4 * 16


def _stop_at(step: int):
    def hook(done: int, loss: float) -> None:
        if done == step:
            raise KeyboardInterrupt
    return hook


@pytest.mark.parametrize(("family", "params"), [("gpt2", "attention"), ("llama", "all"),
                                                ("llama", "lora")])
def test_interrupted_distillation_resumes_to_the_uninterrupted_result(tmp_path, family, params):
    reference = BUILDERS[family]()
    blocks = _blocks()
    options = {"params": params, "lr": 1e-2, "batch_size": 2, "accumulate": 2,
               "tokens": 2 * blocks.n_tokens}

    whole = _pruned(reference)
    expected = distill(whole, reference, blocks, **options)
    assert expected["steps"] == 6

    model = _pruned(reference)
    start = _state(model)
    with pytest.raises(KeyboardInterrupt):
        distill(model, reference, blocks, checkpoint=Checkpoint(tmp_path, every=2),
                on_step=_stop_at(3), **options)
    _assert_same(_state(model), start)  # an interrupted distillation leaves the model as it was
    assert Checkpoint(tmp_path).get("recover/distill")["step"] == 3
    steps = []
    resumed = distill(model, reference, blocks, checkpoint=Checkpoint(tmp_path, every=2),
                      on_step=lambda done, loss: steps.append(done), **options)
    assert steps == [4, 5, 6]
    _assert_same(_state(model), _state(whole))
    assert resumed["losses"] == expected["losses"]

    # a finished distillation called again with its checkpoint gives the same model
    again = _pruned(reference)
    distill(again, reference, blocks, checkpoint=Checkpoint(tmp_path, every=2),
            on_step=lambda done, loss: steps.append(done), **options)
    assert steps == [4, 5, 6]
    _assert_same(_state(again), _state(whole))


def test_a_stop_requested_through_the_progress_loop_resumes_exactly(tmp_path, monkeypatch):
    reference = _gpt2()
    blocks = _blocks()
    options = {"params": "out", "lr": 1e-2, "batch_size": 2}
    whole = _pruned(reference)
    expected = distill(whole, reference, blocks, **options)

    def stop(done, loss):
        if done == 4:
            _progress.request_stop()  # what the CLI's signal handler does

    model = _pruned(reference)
    monkeypatch.setattr(_progress, "_stop_requested", False)
    with pytest.raises(KeyboardInterrupt):
        distill(model, reference, blocks, checkpoint=Checkpoint(tmp_path, every=10),
                on_step=stop, **options)
    monkeypatch.setattr(_progress, "_stop_requested", False)
    saved = Checkpoint(tmp_path).get("recover/distill")
    assert saved["step"] == 4
    steps = []
    resumed = distill(model, reference, blocks, checkpoint=Checkpoint(tmp_path),
                      on_step=lambda done, loss: steps.append(done), **options)
    assert steps == [5, 6]
    _assert_same(_state(model), _state(whole))
    assert resumed["losses"] == expected["losses"]


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_lora_merges_into_plain_weights_with_the_adapter_logits(family):
    reference = BUILDERS[family]()
    pruned = _pruned(reference)
    blocks = _blocks()
    keys = list(pruned.state_dict())
    start = _state(pruned)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    adapter_logits = {}

    def capture(done, loss):  # the last step's model, adapters still apart
        if done == 3:
            with torch.no_grad():
                adapter_logits["x"] = pruned(x).logits
            assert any(type(m).__module__.startswith("peft") for m in pruned.modules())

    summary = distill(pruned, reference, blocks, params="lora", lora_rank=2, lr=1e-2,
                      batch_size=4, on_step=capture)
    assert summary["steps"] == 3
    with torch.no_grad():
        merged = pruned(x).logits
    torch.testing.assert_close(merged, adapter_logits["x"], rtol=1e-5, atol=1e-5)
    assert not any(type(m).__module__.startswith("peft") for m in pruned.modules())
    assert list(pruned.state_dict()) == keys
    assert all(type(a.q_proj) is torch.nn.Linear for a in pruned.attentions)
    changed = {k for k, v in pruned.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(k.split(".")[-2].endswith("_proj") for k in changed)
    assert all(p.requires_grad for p in pruned.parameters())


def test_out_trains_only_the_output_projections():
    reference = _llama()
    pruned = _pruned(reference)
    start = _state(pruned)
    distill(pruned, reference, _blocks(), params="out", lr=1e-2, batch_size=4)
    after = _state(pruned)
    changed = {k for k in start if not torch.equal(start[k], after[k])}
    assert changed == {f"blocks.{i}.attn.o_proj.weight" for i in range(2)}  # Llama: no bias


def test_out_trains_the_output_bias_where_there_is_one():
    reference = _gpt2()
    pruned = _pruned(reference)
    start = _state(pruned)
    distill(pruned, reference, _blocks(), params="out", lr=1e-2, batch_size=4)
    changed = {k for k, v in pruned.state_dict().items() if not torch.equal(start[k], v)}
    assert changed == {f"blocks.{i}.attn.o_proj.{w}" for i in range(2) for w in ("weight", "bias")}


def test_every_kind_of_model_distils():
    """masked-LM (KL at the labelled positions), classifier (KL + labels), embedding
    (1 - cos): each loss goes down on a tiny BERT."""
    labels_mlm = torch.full((12, 16), -100)
    labels_mlm[:, 2:6] = torch.randint(0, VOCAB, (12, 4), generator=torch.Generator())
    cases = {"mlm": labels_mlm, "classifier": torch.arange(12) % 2, "none": None}
    for head, labels in cases.items():
        torch.manual_seed(0)
        reference = Bert(BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=32,
                                    max_position_embeddings=32), head=head)
        summary = distill(_pruned(reference), reference, _blocks(labels=labels),
                          params="all", lr=3e-3, batch_size=4, tokens=10 * 12 * 16)
        losses = summary["losses"]
        assert sum(losses[-3:]) < sum(losses[:3]), head


# ---------------------------------------------------------------------- bad input
@pytest.mark.parametrize(("kwargs", "message"), [
    ({"tokens": 0}, "--recover-tokens must be a positive"),
    ({"tokens": -3}, "--recover-tokens must be a positive"),
    ({"params": "mlp"}, "choose from out, attention, all, lora"),
    ({"temperature": 0.0}, "temperature"),
    ({"accumulate": 0}, "accumulation"),
])
def test_bad_options_are_refused(kwargs, message):
    reference = _gpt2()
    with pytest.raises(UserError, match=message):
        distill(_pruned(reference), reference, _blocks(), **kwargs)


def test_lora_without_peft_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft -> ImportError
    reference = _gpt2()
    with pytest.raises(UserError, match="lora needs the peft package: pip install peft"):
        distill(_pruned(reference), reference, _blocks(), params="lora")


def test_the_reference_must_be_another_model():
    reference = _gpt2()
    with pytest.raises(UserError, match="reference"):
        distill(reference, reference, _blocks())


@pytest.mark.parametrize("params", ["all", "lora"])
def test_a_non_finite_loss_names_the_step_and_restores_the_weights(params):
    reference = _gpt2()
    pruned = _pruned(reference)
    start = _state(pruned)

    def poison(done, loss):  # from step 3 the teacher says NaN
        if done == 2:
            with torch.no_grad():
                reference.blocks[0].attn.q_proj.weight.fill_(float("nan"))

    with pytest.raises(UserError, match="at step 3"):
        distill(pruned, reference, _blocks(), params=params, lr=1e-2, batch_size=2,
                on_step=poison)
    _assert_same(_state(pruned), start)
    assert not any(type(m).__module__.startswith("peft") for m in pruned.modules())
    assert all(p.requires_grad for p in pruned.parameters())


def test_a_checkpoint_of_other_options_is_refused(tmp_path):
    reference = _gpt2()
    blocks = _blocks()
    with pytest.raises(KeyboardInterrupt):
        distill(_pruned(reference), reference, blocks, batch_size=2,
                checkpoint=Checkpoint(tmp_path), on_step=_stop_at(2))
    with pytest.raises(UserError, match="other options lr"):
        distill(_pruned(reference), reference, blocks, batch_size=2, lr=1e-3,
                checkpoint=Checkpoint(tmp_path))
    with pytest.raises(UserError, match="other data"):
        distill(_pruned(reference), reference, _blocks(seed=1), batch_size=2,
                checkpoint=Checkpoint(tmp_path))
    with pytest.raises(UserError, match="other trainable tensors"):
        distill(reference, _gpt2(), blocks, batch_size=2, checkpoint=Checkpoint(tmp_path))
