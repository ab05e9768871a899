"""The family registry, the required model interface and the model directory's format
(`headlab.models.registry`, `HeadModel.interface_gaps`, `headlab.models.format`); the
sharded writer and reader of the same directory are tested in test_sharding.py."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from test_decoders import _checkpoint
from transformers import GemmaTokenizer

import headlab
from headlab.errors import ModelNotFoundError, UserError
from headlab.models import registry
from headlab.models.base import Absent, HeadModel
from headlab.models.decoder import Decoder
from headlab.models.loading import gguf_cache_dir

HF_TYPES = {
    "gpt2": ("gpt2",), "llama": ("llama", "mistral"), "qwen2": ("qwen2",),
    "qwen3": ("qwen3",), "gemma2": ("gemma2",), "gemma3": ("gemma3", "gemma3_text"),
    "phi3": ("phi3",), "gpt_neox": ("gpt_neox",), "olmo2": ("olmo2",), "bert": ("bert",),
    "roberta": ("roberta", "xlm-roberta"), "distilbert": ("distilbert",),
    "modernbert": ("modernbert",),
}


def test_every_family_registers_its_class_and_hf_types():
    found = {f.cls.family: f.hf_types for f in registry.families()}
    assert found == HF_TYPES
    for family in registry.families():
        assert family.cls.interface_gaps() == []
        assert registry.by_name(family.cls.family) is family
        assert all(registry.by_hf_type(t) is family for t in family.hf_types)


def test_lookups_of_unknown_names_say_what_is_known():
    with pytest.raises(ModelNotFoundError, match=r"^unknown model family 'nope'; this "
                                                 r"headlab knows bert, distilbert, "):
        registry.by_name("nope")
    with pytest.raises(ModelNotFoundError, match=r"^architecture 'nope' is not supported; "
                                                 r"supported model types: bert, "):
        registry.by_hf_type("nope")


def _from_hf(config, state, *, path=None):
    raise AssertionError("never called")


def test_a_class_missing_a_piece_of_the_interface_is_refused_when_registered():
    class Bare(HeadModel):
        family = "bare"

    with pytest.raises(TypeError) as err:
        registry.register(Bare, hf_types=("bare",), from_hf=_from_hf)
    for piece in ("config_class", "final_norm", "mlp_down", "max_positions",
                  "hf_export_unsupported"):
        assert f"{piece}: " in str(err.value)

    class NoBiasKey(Decoder):  # the shared decoder exports: its families name the key
        family = "no-bias-key"

    with pytest.raises(TypeError, match=r"NoBiasKey does not declare .*: "
                                        r"hf_attention_bias_key: the HF config key"):
        registry.register(NoBiasKey, hf_types=("no-bias-key",), from_hf=_from_hf)
    assert len(NoBiasKey.interface_gaps()) == 1
    with pytest.raises(ModelNotFoundError):
        registry.by_name("no-bias-key")


def test_a_declared_absence_completes_the_interface():
    class Declared(Decoder):
        family = "declared"
        hf_attention_bias_key = Absent("its HF config has no such key")

    assert Declared.interface_gaps() == []
    assert not Declared.hf_attention_bias_key
    assert Declared.hf_attention_bias_key.reason == "its HF config has no such key"


def test_a_name_is_registered_once():
    qwen3 = registry.by_name("qwen3").cls

    class Impostor(qwen3):
        pass

    with pytest.raises(TypeError, match=r"Impostor: 'qwen3' is registered by "
                                        r"headlab\.models\.qwen\.Qwen3$"):
        registry.register(Impostor, hf_types=(), from_hf=_from_hf)
    assert registry.by_name("qwen3").cls is qwen3


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_a_saved_directory_records_and_restores_the_exact_class(tmp_path, case):
    model = headlab.load(_checkpoint(tmp_path / "hf", case), tokenizer=False)
    saved = model.save(tmp_path / "saved")
    meta = json.loads((saved / "config.json").read_text())
    assert meta["headlab_format"] == 1 and meta["family"] == case
    assert sorted(meta) == ["config", "extra", "family", "headlab_format", "kind", "layout",
                            "out_bias", "streaming"]
    back = headlab.load(saved, tokenizer=False)
    assert type(back) is type(model)
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, model(ids).logits)


def test_a_saved_gemma_tokenizer_reloads_without_transformers_mistral_warning(tmp_path):
    """transformers 5 takes a tokenizer beside a config.json with no model_type for a
    Mistral one with a wrong regex and warns that tokenization will be wrong; headlab's
    format keeps the model type inside, so loading says it is not Mistral's, and
    writes nothing of that into the tokenizer_config it saves."""
    model = headlab.load(_checkpoint(tmp_path / "hf", "gemma3"), tokenizer=False)
    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    words = [*special, *(f"w{i}" for i in range(100_001))]  # it checks vocabularies > 100k
    model.tokenizer = GemmaTokenizer(vocab={w: i for i, w in enumerate(words)}, merges=[])
    saved = model.save(tmp_path / "saved")
    said: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = said.append
    hf_log = logging.getLogger("transformers")  # its own handler, not propagated to caplog
    hf_log.addHandler(handler)
    try:
        back = headlab.load(saved)
    finally:
        hf_log.removeHandler(handler)
    assert not [r for r in said if "fix_mistral_regex" in r.getMessage()]
    assert back.tokenizer("w3 w7")["input_ids"] == model.tokenizer("w3 w7")["input_ids"]
    back.save(tmp_path / "again")
    assert "fix_mistral_regex" not in (tmp_path / "again" / "tokenizer_config.json").read_text()


def test_a_gguf_conversion_is_found_by_the_file_content_not_its_install(tmp_path, monkeypatch):
    """A reinstalled GGUF (a new virtual environment: same bytes, new path and time)
    finds the conversion made before; a changed file is converted again."""
    monkeypatch.setenv("HEADLAB_CACHE", str(tmp_path / "cache"))
    first, again = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for f in (first, again):
        f.parent.mkdir()
        f.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    os.utime(again, ns=(10**18, 10**18))
    assert gguf_cache_dir(first) == gguf_cache_dir(again)
    assert gguf_cache_dir(first).parent == tmp_path / "cache" / "gguf"
    again.write_bytes(b"GGUF" + bytes(range(255, -1, -1)) * 64)
    assert gguf_cache_dir(again) != gguf_cache_dir(first)


def test_a_directory_of_an_unknown_format_or_family_is_refused_naming_it(tmp_path):
    model = headlab.load(_checkpoint(tmp_path / "hf", "qwen2"), tokenizer=False)
    saved = model.save(tmp_path / "saved")
    meta = json.loads((saved / "config.json").read_text())
    (saved / "config.json").write_text(json.dumps({**meta, "headlab_format": 2}))
    with pytest.raises(UserError, match=rf"^{saved}: headlab format 2 is not supported "
                                        r"\(this headlab reads format 1\); upgrade headlab$"):
        headlab.load(saved, tokenizer=False)
    (saved / "config.json").write_text(json.dumps({**meta, "family": "qwen9"}))
    with pytest.raises(ModelNotFoundError, match=rf"^{saved}: unknown model family 'qwen9'"):
        headlab.load(saved, tokenizer=False)

