"""Random configurations never crash the argument checks: valid or one clear UserError."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from headlab.config import RunConfig, load_recipe
from headlab.errors import UserError

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
        assert str(exc) and "\n" not in str(exc)
        return
    # whatever passed validation is in range
    assert cfg.keep is None or 0 < cfg.keep <= 1
    assert cfg.batch_size >= 1 and cfg.max_tokens >= 1 and 0 < cfg.step <= 1
    assert cfg.probes >= 1


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(min_size=0, max_size=20), max_size=4))
def test_recipe_overrides_accept_or_say_why(tmp_path_factory, overrides):
    path = Path(tmp_path_factory.mktemp("r")) / "r.toml"
    path.write_text('# headlab run r.toml\nmodel = "minilm-l6"\nkeep = 0.5\n')
    try:
        load_recipe(path, overrides)
    except UserError as exc:
        assert str(exc)
