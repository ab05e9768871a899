"""Random configurations never crash the argument checks: either a configuration whose
every key is in range, or one line that names the key at fault."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from headlab.errors import UserError
from headlab.runs.config import (
    DEFAULT_METHOD,
    DEVICES,
    DTYPES,
    METHODS,
    SCHEDULES,
    UNTARGETED_METHOD,
    RunConfig,
    load_recipe,
)

_values = st.one_of(
    st.none(), st.booleans(), st.integers(-10**6, 10**6),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.text(max_size=6), max_size=3),
)
_keys = st.sampled_from([f.name for f in RunConfig.__dataclass_fields__.values()]
                        + ["kep", "models", "", "keep "])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6))
def test_run_config_accepts_or_says_why(d):
    d = {"model": "minilm-l6", **d}
    try:
        cfg = RunConfig.from_dict(d)
    except UserError as exc:
        message = str(exc)
        assert message and "\n" not in message
        # the message names the key at fault, given or missing (as a key or as its --flag)
        keys = set(d) | set(RunConfig.__dataclass_fields__)
        named = [k for k in keys if k.strip() and (k.strip() in message
                                                   or k.replace("_", "-") in message)]
        assert named, f"{message!r} names none of {sorted(keys)}"
        return
    # whatever passed validation is in range, and is what was given
    assert all(getattr(cfg, k) == v or (v != v)  # NaN never passes
               or (k, v) == ("method", None) for k, v in d.items())  # None: the default
    assert cfg.keep is None or 0 < cfg.keep <= 1
    assert cfg.prune is None or cfg.prune >= 1
    assert cfg.keep is None or cfg.prune is None
    assert cfg.batch_size >= 1 and cfg.max_tokens >= 1 and 0 < cfg.step <= 1
    assert cfg.probes >= 1 and cfg.checkpoint_every >= 1 and cfg.min_heads_per_layer >= 0
    assert cfg.seq_len is None or cfg.seq_len >= 4
    assert 0 < cfg.heldout < 1
    assert cfg.method in METHODS and set(cfg.compare) <= set(METHODS)
    assert cfg.schedule in (*SCHEDULES, None) and cfg.dtype in DTYPES
    assert cfg.device in DEVICES or cfg.device.startswith("cuda:")
    assert RunConfig.from_dict(cfg.to_dict()) == cfg


def test_a_method_left_unsaid_is_the_default_where_a_target_is_given():
    """The gates train toward a number of heads: the default wherever a run names one; a
    score run that names none scores with taylor; a method given is kept."""
    assert (DEFAULT_METHOD, UNTARGETED_METHOD) == ("gates", "taylor")
    for kw in ({"keep": 0.6}, {"prune": 3}, {"unit": "kv-group", "kv_keep": 0.5}):
        assert RunConfig.from_dict({"model": "m", **kw}).method == "gates", kw
    assert RunConfig.from_dict({"model": "m", "command": "score"}).method == "taylor"
    assert RunConfig.from_dict({"model": "m", "command": "score", "keep": 0.6}).method == "gates"
    assert RunConfig.from_dict({"model": "m", "command": "score", "method": "michel"}
                               ).method == "michel"
    cfg = RunConfig.from_dict({"model": "m", "keep": 0.6})
    assert RunConfig.from_dict(cfg.to_dict()) == cfg  # a resumed run keeps what it ran


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=20), max_size=4))
def test_recipe_overrides_accept_or_say_why(tmp_path_factory, overrides):
    path = Path(tmp_path_factory.mktemp("r")) / "r.toml"
    path.write_text('# headlab run r.toml\nmodel = "minilm-l6"\nkeep = 0.5\n')
    try:
        config = load_recipe(path, overrides)
    except UserError as exc:
        message = str(exc)
        assert message and "\n" not in message
        # a malformed override is quoted; a bad key or value is named
        keys = [o.split("=", 1)[0].strip() for o in overrides]
        assert any(repr(o) in message or repr(k) in message or (k and k in message)
                   for o, k in zip(overrides, keys, strict=True)), \
            f"{message!r} names none of {overrides}"
        return
    # every override took effect, the last one of a key winning
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        assert key in config
    assert RunConfig.from_dict(config).model == config["model"]


# one bad value per key, the rest valid: the one line names that key (or its --flag)
_BAD = {
    "command": "train", "method": "magic", "compare": ["magic"], "keep": 1.5, "prune": 0,
    "schedule": "sometimes", "step": 0.0, "per_layer": "yes", "min_heads_per_layer": -1,
    "data": 3, "max_tokens": 0, "seq_len": 2, "batch_size": 0, "heldout": 1.0, "seed": "x",
    "normalize": "on", "probes": 0, "device": "tpu", "dtype": "float8", "out": 5,
    "export": "onnx", "sample_tokens": 1, "checkpoint_every": 0, "latency_batch": 0,
    "latency_seq_len": 0, "model": "", "recover": "magic", "recover_ridge": -1.0,
    "recover_tokens": 0, "recover_params": "everything", "recover_lr": 0.0,
    "recover_temperature": -1.0, "recover_every_step": "yes",
}


@pytest.mark.parametrize("key", sorted(_BAD))
def test_a_bad_value_is_refused_naming_its_key(key):
    d = {"model": "minilm-l6", "keep": 0.5, key: _BAD[key]}
    if key == "prune":
        del d["keep"]
    with pytest.raises(UserError) as info:
        RunConfig.from_dict(d)
    message = str(info.value)
    assert "\n" not in message
    assert key in message or key.replace("_", "-") in message, message
