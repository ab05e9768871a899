"""The conformance matrix: every feature on every family (`_families.MATRIX` x
`_families.FEATURES`), each family a tiny random checkpoint written once per session by
transformers' ``save_pretrained`` and loaded once.

A feature a family cannot have is skipped with the reason the family declares
(`HeadModel.not_applicable`, or its kind: an encoder keeps no KV cache), so ``-ra``
prints it; the README's capability table is rendered from the same declarations
(scripts/capability_table.py) and `test_readme_table_is_the_matrix` keeps them equal.

Tolerances: against transformers the bound test_decoders.py and test_encoders.py use
for float32 logits (1e-4); between two headlab computations of the same function 1e-5.
Shape notation: B batch, S sequence, H query heads, H_kv key/value heads, D head dim,
E model dim, L layers, T keys.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers as tf
from _encoders import bpe_tokenizer as encoder_bpe_tokenizer
from _families import (
    FEATURES,
    MATRIX,
    capability_table,
    export_gap,
    family_classes,
    gaps,
    model_class,
    readme_table,
)
from _gates import gate_leaves
from torch.testing import assert_close

from headlab import capture, load, load_texts, make_blocks, prepare
from headlab.analysis.attribution import logit_attribution
from headlab.analysis.patching import logit_diff, patch, patched_metric
from headlab.attention.hooks import hook_names
from headlab.detectors import detect, kinds_for
from headlab.errors import UserError
from headlab.evaluate.cache import step_bytes
from headlab.importance import METHODS, TARGETED, HeadScores, score
from headlab.models.base import HeadModel
from headlab.models.export import export_hf, hf_expressible
from headlab.objectives import objective_for
from headlab.pruning import copy_model, demote, prune
from headlab.recovery import recover
from headlab.selection import PrunePlan, kv_groups, select_groups

ROOT = Path(__file__).resolve().parents[1]
LOGITS = {"rtol": 0.0, "atol": 1e-4}  # float32 logits against transformers
SAME = {"rtol": 0.0, "atol": 1e-5}  # one function computed two ways by headlab
HOOKS = ("q", "k", "v", "scores", "pattern", "z", "out")
each_family = pytest.mark.parametrize("family", list(MATRIX))


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def encoder_tokenizer():
    """One BERT-style tokenizer for every encoder ([PAD] = 0 ... [MASK] = 4)."""
    return encoder_bpe_tokenizer(cls="[CLS]", sep="[SEP]", pad="[PAD]", mask="[MASK]",
                                 unk="[UNK]", specials=["[PAD]", "[UNK]", "[CLS]", "[SEP]",
                                                        "[MASK]"])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory, bpe_tokenizer, encoder_tokenizer):
    """family -> its checkpoint directory, written on first use, once per session."""
    root = tmp_path_factory.mktemp("families")
    written: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in written:
            entry = MATRIX[family]
            tok = bpe_tokenizer if entry.causal else encoder_tokenizer
            (root / family).mkdir()
            written[family] = Path(entry.write(root / family, tok))
        return written[family]
    return get


@pytest.fixture(scope="session")
def loaded(checkpoints):
    """family -> its headlab model, loaded once; a test that changes it works on a copy."""
    models: dict[str, HeadModel] = {}

    def get(family: str) -> HeadModel:
        if family not in models:
            models[family] = load(checkpoints(family))
        return models[family]
    return get


@pytest.fixture(scope="session")
def scoring_blocks(loaded):
    """family -> 8 prepared blocks of 12 tokens of the bundled text."""
    made = {}

    def get(family: str):
        if family not in made:
            model = loaded(family)
            blocks = make_blocks(load_texts(), model.tokenizer, kind=model.kind, seq_len=12,
                                 max_tokens=12 * 8)
            made[family] = prepare(model, blocks.subset(list(range(8))), batch_size=4)
        return made[family]
    return get


def _skip_unless_applies(family: str, feature: str) -> None:
    reason = gaps(family).get(feature)
    if reason is not None:
        pytest.skip(f"{feature} on {family}: {reason}")


def _batch(model: HeadModel, *, rows: int = 3, length: int = 12, padded: bool = True):
    """ids (B, S) away from the special ids; with ``padded``, row 1 left-padded by 3 and
    row 2 right-padded by 2 (pad ids there)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(5, 97, (rows, length), generator=g)
    mask = torch.ones(rows, length, dtype=torch.long)
    if padded:
        mask[1, :3] = 0
        mask[2, -2:] = 0
        ids = ids.masked_fill(mask == 0, model.tokenizer.pad_token_id or 0)
    return ids, mask


@torch.no_grad()
def _logits(model: HeadModel, ids, mask=None) -> torch.Tensor:
    return model(ids, mask).logits


def _hf(directory, causal: bool):
    auto = tf.AutoModelForCausalLM if causal else tf.AutoModelForMaskedLM
    return auto.from_pretrained(directory, attn_implementation="eager",
                                dtype=torch.float32).eval()


def _plan(model: HeadModel, pruned: dict[int, list[int]],
          demoted: dict[int, list[int]] | None = None) -> PrunePlan:
    kept = {i: [h for h in heads if h not in pruned.get(i, [])]
            for i, heads in enumerate(model.head_ids())}
    return PrunePlan(kept, {i: pruned.get(i, []) for i in kept}, demoted or {})


def _altered(model: HeadModel) -> HeadModel:
    """A copy with a GQA group pruned from the first layer, the last layer's last group
    demoted (decoders; sinks 2, window 4) and a W_O bias on the first layer: what a
    saved model must carry."""
    out = copy_model(model)
    groups = kv_groups(out)
    last = out.n_layers - 1
    plan = _plan(out, {0: groups[0][0]}, {last: groups[last][-1]} if out.causal else None)
    if out.causal:
        demote(out, plan, sinks=2, window=4)
    else:
        prune(out, plan)
    with torch.no_grad():
        out.attentions[0].ensure_out_bias().normal_(0.0, 0.1)
    return out


def _streaming(model: HeadModel) -> list:
    return [a.streaming.to_json() if a.streaming is not None else None
            for a in model.attentions]


# ---------------------------------------------------------------------- features
@each_family
def test_transformers(family, checkpoints, loaded):
    """headlab builds the family's exact class, and its logits (decoders) or MLM logits
    (encoders) equal transformers' on a padded batch."""
    model = loaded(family)
    assert type(model) is model_class(MATRIX[family].family)
    hf = _hf(checkpoints(family), MATRIX[family].causal)
    ids, mask = _batch(model)
    valid = mask.bool()  # padded query positions are not compared
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    assert_close(_logits(model, ids, mask)[valid], expected[valid], **LOGITS)


@each_family
def test_hooks(family, loaded):
    """Every ``blocks.{i}.attn.{q|k|v|scores|pattern|z|out}`` exists and captures the
    shape headlab.attention.hooks documents."""
    model = loaded(family)
    ids, _ = _batch(model, rows=2, length=10, padded=False)
    B, S = ids.shape
    names = [f"blocks.{i}.attn.{h}" for i in range(model.n_layers) for h in HOOKS]
    assert set(names) <= set(hook_names(model))
    with capture(model, names) as cap, torch.no_grad():
        model(ids)
    for i, a in enumerate(model.attentions):
        H, H_kv, D, E = a.n_heads, a.n_kv_heads, a.head_dim, a.d_model
        shapes = {"q": (B, S, H, D), "k": (B, S, H_kv, D), "v": (B, S, H_kv, D),
                  "scores": (B, H, S, S), "pattern": (B, H, S, S), "z": (B, S, H, D),
                  "out": (B, S, E)}
        for hook, shape in shapes.items():
            assert tuple(cap[f"blocks.{i}.attn.{hook}"].shape) == shape, (i, hook)


@each_family
def test_scores(family, loaded, scoring_blocks):
    """Every importance method gives finite scores, layers x heads; taylor's curvature
    probes are draws of the Fisher identity (`_check_curvature_probes`)."""
    model = loaded(family)
    if model.kind == "causal-lm":
        ids, mask = _batch(model)
        _check_curvature_probes(model, {"input_ids": ids, "attention_mask": mask})
    else:
        _check_curvature_probes(model, next(iter(scoring_blocks(family).batches(4))))
    for method in METHODS:
        target = {"target": model.n_layers} if method in TARGETED else {}  # gates
        s = score(model, scoring_blocks(family), method=method, batch_size=4, probes=1,
                  gate_steps=4, **target)
        t = s.tensor()
        assert t.shape == (model.n_layers, model.n_original_heads), method
        assert bool(torch.isfinite(t).all()), method
        if method in TARGETED:  # the default budget, projection: on the target exactly
            assert s.extra["budget"] == "projection", method
            assert s.extra["expected_open"] == pytest.approx(model.n_layers, rel=1e-6)
    lagrangian = score(model, scoring_blocks(family), method="gates", batch_size=4,
                       gate_steps=4, target=model.n_layers, gate_budget="lagrangian")
    assert bool(torch.isfinite(lagrangian.tensor()).all())
    per_token = score(model, scoring_blocks(family), method="gates", batch_size=4,
                      gate_steps=4, target=model.n_layers, gate_sample="token")
    assert bool(torch.isfinite(per_token.tensor()).all()) and per_token.extra["sample"] == "token"
    assert per_token.extra["expected_open"] == pytest.approx(model.n_layers, rel=1e-6)


def _check_curvature_probes(model, batch) -> None:
    """taylor's curvature probes give, draw by draw, the gate gradients of the cotangent
    (p - onehot(y)) / sqrt(T) on an example's T scored logits, y drawn from p itself
    (the Fisher identity): decoders take it back from the final hidden states, through
    soft-capping where configured (gemma2), on a batch with padding on both sides."""
    with gate_leaves(model, len(batch["input_ids"])) as gates:  # (B, H) each
        objective = objective_for(model)
        out = objective.forward(model, batch)
        if model.kind == "causal-lm":
            mask = batch["attention_mask"]
            logits, valid = out.logits[:, :-1], (mask[:, 1:] * mask[:, :-1]).float()
        else:
            logits, valid = out.logits, (batch["labels"] != -100).float()
        p = logits.detach().softmax(-1)  # (B, T, V)
        n = 3
        drawn = torch.multinomial(p.reshape(-1, p.shape[-1]), n, replacement=True,
                                  generator=torch.Generator().manual_seed(7))  # (B*T, n)
        scale = valid / valid.sum(1, keepdim=True).clamp(min=1).sqrt()  # (B, T)
        probes = objective.curvature_probes(model, out, batch, n,
                                            torch.Generator().manual_seed(7))
        for j, (output, cotangent) in enumerate(probes):
            onehot = F.one_hot(drawn[:, j].view(p.shape[:2]), p.shape[-1])
            expected = torch.autograd.grad(logits, gates, (p - onehot) * scale[..., None],
                                           retain_graph=True)
            got = torch.autograd.grad(output, gates, cotangent, retain_graph=True)
            for e, g in zip(expected, got, strict=True):
                assert_close(g, e, rtol=1e-4, atol=1e-7)
        assert j == n - 1


@each_family
def test_gate_equals_prune(family, loaded):
    """Gating heads to 0 equals removing them, a layer that loses every head included;
    a family that declares single heads apart is checked on the whole layer only."""
    model = loaded(family)
    ids, mask = _batch(model)
    valid = mask.bool()

    def check(heads: dict[int, list[int]]) -> None:
        gated, pruned = copy_model(model), copy_model(model)
        gated.mask_heads(heads)
        pruned.prune_heads(heads)
        assert pruned.heads_per_layer[0] == 0
        assert_close(_logits(pruned, ids, mask)[valid], _logits(gated, ids, mask)[valid],
                     **SAME)

    whole = {0: list(range(model.n_original_heads))}
    check(whole)
    _skip_unless_applies(family, "gate-equals-prune")
    check({**whole, model.n_layers - 1: [1]})


@each_family
def test_kv_groups(family, loaded, checkpoints):
    """Pruning by GQA group keeps whole groups, and the key/value cache per token
    shrinks by the key/value heads removed, in the figure and in the keys attention
    produces (the k and v hooks are what the cache stores); the bytes a decoding step
    reads are transformers' weights and that cache."""
    _skip_unless_applies(family, "kv-groups")
    hf_weights = 4 * _hf(checkpoints(family), MATRIX[family].causal).num_parameters()
    assert step_bytes(loaded(family), 0) == hf_weights  # float32, tied matrices once
    model = copy_model(loaded(family))
    groups = kv_groups(model)
    before, kv_before = model.kv_cache_bytes_per_token(), sum(model.kv_heads_per_layer)
    g = torch.Generator().manual_seed(0)
    scores = HeadScores(torch.rand(model.n_layers, model.n_original_heads,
                                   generator=g).tolist(), "random")
    n_groups = sum(len(layer) for layer in groups)
    prune(model, select_groups(scores, groups, n_groups // 2, per_layer=True))
    for layer, kept in enumerate(model.head_ids()):
        for group in groups[layer]:
            assert set(group) <= set(kept) or not set(group) & set(kept), (layer, group)
    assert model.kv_heads_per_layer == [len(layer) // 2 for layer in groups]
    after = model.kv_cache_bytes_per_token()
    assert after == before * sum(model.kv_heads_per_layer) / kv_before < before
    ids, _ = _batch(model, rows=1, length=6, padded=False)
    with capture(model, ["k", "v"]) as cap, torch.no_grad():
        model(ids, cache=model.new_cache())
    stored = sum(t[0, 0].numel() * t.element_size() for t in cap.tensors.values())
    assert stored == after
    assert step_bytes(model, 7) - step_bytes(model, 0) == 7 * stored


@each_family
def test_demotion(family, loaded):
    """Demoted heads whose sinks + window cover the sequence change nothing; with a
    window that cuts (shorter than the layers' own), cached decoding equals the demoted
    model's own full forward."""
    _skip_unless_applies(family, "demotion")
    model = loaded(family)
    ids, _ = _batch(model, rows=2, padded=False)
    S = ids.shape[1]
    groups = kv_groups(model)
    plan = _plan(model, {}, {i: groups[i][0] for i in range(model.n_layers)})
    covering = demote(model, plan, sinks=2, window=S - 2, inplace=False)
    assert_close(_logits(covering, ids), _logits(model, ids), **SAME)
    narrow = demote(model, plan, sinks=2, window=2, inplace=False)
    full = _logits(narrow, ids)
    assert (full - _logits(model, ids)).abs().max() > 1e-3  # the window does cut
    cache = narrow.new_cache()
    with torch.no_grad():
        steps = [narrow(ids[:, :5], cache=cache).logits]
        steps += [narrow(ids[:, t:t + 1], cache=cache).logits for t in range(5, S)]
    assert_close(torch.cat(steps, dim=1), full, **SAME)


@each_family
def test_lsq(family, loaded, scoring_blocks):
    """lsq never leaves a layer's error above where it started, and refits the MLP's
    down projection of every layer."""
    reference = loaded(family)
    pruned = prune(reference, _plan(reference, {0: [0], reference.n_layers - 1: [1, 2]}),
                   inplace=False)
    report = recover(pruned, reference, scoring_blocks(family), method="lsq", batch_size=4)
    assert [e.layer for e in report.layers] == list(range(reference.n_layers))
    for e in report.layers:
        assert e.error_after <= e.error_before, e
        assert e.mlp_error_before is not None, (
            f"layer {e.layer}: lsq did not refit the MLP's down projection "
            f"({type(pruned).__name__}.mlp_down = {pruned.mlp_down!r})")
        assert e.mlp_error_after <= e.mlp_error_before, e


@each_family
def test_rescale(family, loaded, scoring_blocks):
    """rescale (Kwon et al.'s, solved by LSMR) walks every layer of every family that
    names its MLP's down projection: no sublayer's error rises, and every weight stays
    finite."""
    reference = loaded(family)
    pruned = prune(reference, _plan(reference, {0: [0], reference.n_layers - 1: [1, 2]}),
                   inplace=False)
    report = recover(pruned, reference, scoring_blocks(family), method="rescale",
                     batch_size=4)
    assert [e.layer for e in report.layers] == list(range(reference.n_layers))
    for e in report.layers:
        assert e.error_after <= e.error_before, e
        assert e.mlp_error_before is not None and e.mlp_error_after <= e.mlp_error_before, e
    assert all(bool(torch.isfinite(p).all()) for p in pruned.parameters())


@each_family
def test_bias(family, loaded, scoring_blocks, tmp_path):
    """bias folds the removed heads' mean into W_O's bias: the first layer (where both
    streams agree) can only improve, and the saved model carries the new bias."""
    reference = loaded(family)
    pruned = prune(reference, _plan(reference, {0: [0, 1], reference.n_layers - 1: [2]}),
                   inplace=False)
    report = recover(pruned, reference, scoring_blocks(family), method="bias", batch_size=4)
    errors = [(e.error_before, e.error_after) for e in report.layers]
    assert len(errors) == reference.n_layers
    assert all(torch.isfinite(torch.tensor(errors)).flatten())
    assert errors[0][1] <= errors[0][0]
    assert pruned.attentions[0].o_proj.bias is not None
    back = load(pruned.save(tmp_path / "saved"), tokenizer=False)
    ids, mask = _batch(pruned)
    assert torch.equal(_logits(back, ids, mask), _logits(pruned, ids, mask))


@each_family
def test_attribution(family, loaded):
    """Direct logit attribution's parts sum to the model's own logit difference (under
    final soft-capping, to the difference before the cap, as TransformerLens does; the
    capped one is the model's output)."""
    _skip_unless_applies(family, "attribution")
    model = loaded(family)
    ids, _ = _batch(model, rows=1, length=10, padded=False)
    position = -1
    if not model.causal:  # a masked LM is attributed at its [MASK]
        position = 3
        ids[0, position] = model.tokenizer.mask_token_id
    got = logit_attribution(model, ids, target=5, foil=9, position=position)
    own = _logits(model, ids)[0, position].double()
    output = got.extra.get("output_logit_diff", got.logit_diff)
    assert_close(output, float(own[5] - own[9]), **SAME)
    if getattr(model.config, "final_softcap", None):
        assert abs(got.logit_diff) > abs(output)  # tanh shrinks what it caps
    assert_close(got.total(), got.logit_diff, **LOGITS)  # test_attribution.py's bound
    heads = torch.tensor(got.heads)
    assert heads.shape == (model.n_layers, model.n_original_heads)
    assert bool(torch.isfinite(heads).all())


@each_family
def test_patching(family, loaded):
    """Activation patching runs on every head, and patching all of them at once gives
    the clean metric back."""
    model = loaded(family)
    clean, _ = _batch(model, rows=2, length=8, padded=False)
    corrupted = clean.clone()
    corrupted[:, 4] = torch.tensor([11, 12])
    metric = logit_diff(torch.tensor([5, 5]), torch.tensor([9, 9]))
    index = torch.arange(2)
    m_clean = metric(_logits(model, clean), index)
    m_corrupted = metric(_logits(model, corrupted), index)
    assert (m_clean - m_corrupted).abs().max() > 1e-4
    every = dict(enumerate(model.head_ids()))
    restored = patched_metric(model, corrupted, clean, metric=metric, heads=every)
    assert_close(restored, m_clean, **SAME)
    result = patch(model, clean, corrupted, metric=metric, n_boot=20)
    for effect in (result.denoise, result.noise):
        t = torch.tensor(effect)
        assert t.shape == (model.n_layers, model.n_original_heads)
        assert bool(torch.isfinite(t).all())


@each_family
def test_detectors(family, loaded):
    """Every detector that applies to the kind gives finite scores, layers x heads."""
    model = loaded(family)
    for kind in kinds_for(model):
        t = detect(model, kind, n=2, seq_len=12, repeat_len=5, batch_size=2).tensor()
        assert t.shape == (model.n_layers, model.n_original_heads), kind
        assert bool(torch.isfinite(t).all()), kind


@each_family
def test_save_load(family, loaded, tmp_path):
    """save -> headlab.load: the same class, heads, demotions and outputs."""
    model = _altered(loaded(family))
    back = load(model.save(tmp_path / "saved"))
    assert type(back) is type(model)
    assert back.head_ids() == model.head_ids()
    assert _streaming(back) == _streaming(model)
    ids, mask = _batch(model)
    assert torch.equal(_logits(back, ids, mask), _logits(model, ids, mask))


def _sharded_worker(rank: int, root: str) -> None:
    """One of two gloo ranks: for every family, load its saved directory sharded, run
    it, save it sharded; what each gave (or the error) goes to rank{rank}.pt."""
    from test_sharding import _group

    from headlab.parallel import sharding

    torch.set_num_threads(1)
    job = torch.load(Path(root) / "jobs.pt")
    results = {}
    with _group("gloo", rank, 2, str(Path(root) / "store")):
        for family, directory in job["dirs"].items():
            try:
                model, _ = sharding.load_sharded(directory)
                cls = next(c for c in type(model).__mro__
                           if issubclass(c, HeadModel) and not sharding._fsdp_class(c))
                logits = _logits(model, job["ids"])
                streaming = _streaming(model)
                sharding.save_sharded(model, Path(root) / "resaved" / family)
                results[family] = {"class": f"{cls.__module__}.{cls.__qualname__}",
                                   "logits": logits, "streaming": streaming}
            except Exception as exc:  # one family's failure is its own cell's
                results[family] = {"error": f"{type(exc).__name__}: {exc}"}
    torch.save(results, Path(root) / f"rank{rank}.pt")


@pytest.fixture(scope="session")
def sharded(tmp_path_factory, loaded):
    """One two-rank gloo job over every family (two processes per family would take
    minutes): the altered model of each, saved, loaded by `load_sharded` and saved
    again by `save_sharded`. Returns (models, ids, per-rank results, root)."""
    root = tmp_path_factory.mktemp("sharded")
    models = {family: _altered(loaded(family)) for family in MATRIX}
    ids, _ = _batch(models["gpt2"], rows=2, length=10, padded=False)
    dirs = {family: str(m.save(root / "saved" / family)) for family, m in models.items()}
    torch.save({"ids": ids, "dirs": dirs}, root / "jobs.pt")
    mp.spawn(_sharded_worker, args=(str(root),), nprocs=2, join=True)
    ranks = [torch.load(root / f"rank{r}.pt") for r in range(2)]
    return models, ids, ranks, root


@each_family
def test_sharded(family, sharded):
    """A saved directory loaded sharded over two gloo ranks is the same class with the
    same demotions and outputs; saved sharded, it loads back the same again."""
    models, ids, ranks, root = sharded
    model = models[family]
    cls = type(model)
    for result in (r[family] for r in ranks):
        assert "error" not in result, result.get("error")
        assert result["class"] == f"{cls.__module__}.{cls.__qualname__}"
        assert result["streaming"] == _streaming(model)
        assert_close(result["logits"], _logits(model, ids), **SAME)
    back = load(root / "resaved" / family, tokenizer=False)
    assert type(back) is cls
    assert _streaming(back) == _streaming(model)
    assert_close(_logits(back, ids), _logits(model, ids), **SAME)


@each_family
def test_export_hf(family, checkpoints, loaded, tmp_path):
    """A pruned shape the family's HF config holds (the same whole GQA groups gone from
    every layer) exports and loads in plain transformers with equal logits; where the
    family declares it cannot, and for uneven layers everywhere, export is refused in
    one line."""
    model = loaded(family)
    groups = kv_groups(model)
    uneven = prune(model, _plan(model, {0: groups[0][0]}), inplace=False)
    even = prune(model, _plan(model, {i: g[0] for i, g in enumerate(groups)}), inplace=False)
    declared = export_gap(type(model))
    refused = [uneven, even] if declared else [uneven]
    for m in refused:
        assert hf_expressible(m) is not None
        with pytest.raises(UserError) as error:
            export_hf(m, tmp_path / "refused")
        assert "\n" not in str(error.value) and hf_expressible(m) in str(error.value)
        if declared:
            assert declared in str(error.value)
    if declared:
        return
    assert hf_expressible(even) is None
    hf = _hf(export_hf(even, tmp_path / "hf"), MATRIX[family].causal)
    assert hf.config.num_attention_heads == len(even.head_ids()[0])
    ids, mask = _batch(even)
    valid = mask.bool()
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
    assert_close(_logits(even, ids, mask)[valid], expected[valid], **LOGITS)


@each_family
def test_generation(family, loaded):
    """Greedy generation with the KV cache equals greedy recomputation without it."""
    _skip_unless_applies(family, "generation")
    model = loaded(family)
    prompt, _ = _batch(model, rows=2, length=4, padded=False)
    got = model.generate(prompt, max_new_tokens=8, eos_token_id=())
    expected = prompt
    for _ in range(8):
        expected = torch.cat([expected, _logits(model, expected)[:, -1:].argmax(-1)], dim=1)
    assert torch.equal(got, expected)


# ---------------------------------------------------------------------- the matrix itself
def test_every_family_in_the_matrix_every_feature_tested_every_declaration_a_feature():
    assert {entry.family for entry in MATRIX.values()} == set(family_classes())
    tests = {name[len("test_"):].replace("_", "-") for name, fn in globals().items()
             if name.startswith("test_") and inspect.isfunction(fn)
             and "family" in inspect.signature(fn).parameters}
    assert tests == set(FEATURES)
    for family in MATRIX:
        assert set(gaps(family)) <= set(FEATURES)  # gaps() also names an unknown key


def test_readme_table_is_the_matrix():
    """The README's capability table is the one the declarations give; after changing
    one, run ``python scripts/capability_table.py``."""
    readme = (ROOT / "README.md").read_text()
    assert readme_table(readme) == capability_table(), (
        "README.md's capability table is stale: run python scripts/capability_table.py")


def test_the_table_script_writes_what_the_test_reads(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("capability_table",
                                                  ROOT / "scripts" / "capability_table.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- capabilities:start -->\nold\n<!-- capabilities:end -->\n"
                      "after\n")
    assert script.main([str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n")
    assert readme_table(text) == capability_table()
    assert script.main([str(readme), "--check"]) == 0
    readme.write_text(text.replace("| yes |", "| no |", 1))
    assert script.main([str(readme), "--check"]) == 1
