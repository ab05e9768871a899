"""The HTML report: attention encoding, script-safe JSON, partial results, size, and the
page itself in headless Chromium with the network blocked."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _report_fixture import make_results, sample_tokens, score_only
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from headlab.report import build_report, decode_attention, encode_attention, write_report
from headlab.report._encoding import script_json
from headlab.results import RunResult

HOSTILE = "</script><img src=x onerror=alert(1)>"
ARTIFACTS = Path(__file__).parent / "artifacts"
QUANT_TOL = 0.5 / 255 + 1e-6  # rounding to the nearest of 256 levels


def _build(results: dict, path: Path) -> Path:
    """Render a results.json dict as the report command does: through RunResult."""
    return build_report(RunResult.from_json(results), path)


def _softmax_attention(shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).mul(3).softmax(dim=-1)  # (L, H, S, S)


def _embedded(html: str) -> dict:
    block = re.search(r'<script type="application/json" id="report-data">(.*?)</script>',
                      html, re.S)
    assert block, "the report has no JSON data block"
    return json.loads(block.group(1))


# ---------------------------------------------------------------- encoding, escaping

def test_attention_round_trip_is_within_one_quantisation_step():
    w = _softmax_attention((2, 3, 7, 7))
    encoded = encode_attention(w)
    assert encoded["encoding"] == "uint8-base64" and encoded["shape"] == [2, 3, 7, 7]
    assert len(base64.b64decode(encoded["data"])) == 2 * 3 * 7 * 7  # one byte per weight
    back = decode_attention(encoded)
    assert back.dtype == np.float32 and back.shape == (2, 3, 7, 7)
    torch.testing.assert_close(torch.from_numpy(back), w, rtol=0, atol=QUANT_TOL)
    assert encode_attention(w.numpy()) == encoded  # numpy and torch inputs agree


@settings(max_examples=50, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(1, 2), st.integers(1, 3),
                                    st.shared(st.integers(1, 6), key="s"),
                                    st.shared(st.integers(1, 6), key="s")),
              elements=st.floats(0, 1, width=32)))
def test_attention_round_trip_any_weights(w):
    back = decode_attention(encode_attention(w))
    np.testing.assert_allclose(back, w, rtol=0, atol=QUANT_TOL)
    assert encode_attention(back) == encode_attention(w)  # decoded values are fixed points


def test_encode_keeps_extremes_exact():
    w = np.array([0.0, 1.0, 1 / 255, 254 / 255], dtype=np.float32).reshape(1, 1, 2, 2)
    np.testing.assert_allclose(decode_attention(encode_attention(w)), w, rtol=0, atol=1e-7)


@pytest.mark.parametrize(("bad", "message"), [
    (np.zeros((2, 4, 4)), "shape"),
    (np.zeros((1, 1, 3, 4)), "shape"),
    (np.full((1, 1, 2, 2), 3.0), r"\[0, 1\]"),
    (np.full((1, 1, 2, 2), np.nan), "NaN"),
])
def test_encode_rejects_what_is_not_attention(bad, message):
    with pytest.raises(ValueError, match=message):
        encode_attention(bad)


def test_decode_rejects_damaged_data():
    encoded = encode_attention(np.zeros((1, 2, 3, 3)))
    with pytest.raises(ValueError, match="damaged"):
        decode_attention(dict(encoded, shape=[1, 2, 4, 4]))
    with pytest.raises(ValueError, match="encoding"):
        decode_attention(dict(encoded, encoding="float16-base64"))


def test_script_json_cannot_close_the_script_or_form_markup():
    obj = {"tokens": [HOSTILE, "a & b", "<!--", "\u2028"], "n": 1.5}
    text = script_json(obj)
    assert not set("<>&") & set(text)
    assert "\u2028" not in text and "\\u003c/script\\u003e" in text
    assert json.loads(text) == obj
    with pytest.raises(ValueError):
        script_json({"x": math.nan})


# ---------------------------------------------------------------- static HTML

@pytest.fixture(scope="module")
def full_results() -> dict:
    return make_results()


def test_report_embeds_data_once_with_policy_naming_its_script(tmp_path, full_results):
    html = _build(full_results, tmp_path / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r"<script\b", html)) == 2  # the data block and the code
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', html).group(1)
    assert "default-src &#39;none&#39;" in csp and "img-src data:" in csp
    code = re.search(r"<script>(.*?)</script>", html, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(code.encode()).digest()).decode()
    assert f"sha256-{digest}" in csp
    data = _embedded(html)
    assert data["sample"]["tokens"] == full_results["sample"]["tokens"]
    assert data["sample"]["attention"]["data"] == full_results["sample"]["attention"]["data"]
    n_pruned = sum(map(sum, data["pruned"]))
    assert n_pruned == full_results["heads_total"] - full_results["heads_kept"]
    assert not re.search(r'(src|href)="(https?:)?//', html)  # nothing to fetch


def test_report_for_144_heads_and_64_tokens_is_under_5_mb(tmp_path, full_results):
    assert full_results["sample"]["attention"]["shape"] == [12, 12, 64, 64]
    size = _build(full_results, tmp_path / "report.html").stat().st_size
    assert 12 * 12 * 64 * 64 < size <= 5 * 1024 * 1024  # holds the sample, stays small


def test_hostile_strings_are_escaped_everywhere(tmp_path):
    r = make_results(layers=2, heads=2, seq=8, tokens=[HOSTILE, *sample_tokens(7)])
    r["model"] = r["clusters"]["names"]["0"] = r["config"]["seed"] = HOSTILE
    r["curves"][HOSTILE] = r["curves"].pop("ablation")
    r["files"]["results"] = "javascript:alert(1)"
    html = _build(r, tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<img" not in html and HOSTILE not in html
    assert 'href="javascript:' not in html
    assert _embedded(html)["sample"]["tokens"][0] == HOSTILE


def test_score_only_run_says_what_was_not_measured(tmp_path, full_results):
    html = _build(score_only(full_results), tmp_path / "r.html").read_text("utf-8")
    assert "score only: nothing was pruned" in html
    assert "not measured" in html
    assert 'class="run-marker"' not in html and 'class="cross"' not in html
    assert _embedded(html)["pruned"] is None


def test_latency_at_the_longer_length_is_a_summary_row(tmp_path, full_results):
    """latency_ms.by_length: the first entry is the run's short latency, each further
    one a row of its own with its batch and the drop its FLOPs predict."""
    r = json.loads(json.dumps(full_results))
    r["latency_ms"]["by_length"] = [
        {"before": 40.1, "after": 31.2, "batch": 16, "seq_len": 128, "predicted_drop": 0.1},
        {"before": 900.0, "after": 600.0, "batch": 1, "seq_len": 2048,
         "predicted_drop": 0.35}]
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert "latency at 2,048 tokens" in html and "the FLOPs predict 35% less" in html
    assert "latency at 128 tokens" not in html


def _speedup_svg(html: str) -> str | None:
    found = re.search(r'<svg class="figure speedup".*?</svg>', html, re.S)
    return found.group(0) if found else None


def test_speedup_against_length_is_drawn_with_the_flop_prediction(tmp_path, full_results):
    """One measured point (before / after) and one predicted (1 / (1 - drop)) per length,
    x the length in tokens, y the speed-up."""
    r = json.loads(json.dumps(full_results))
    r["latency_ms"]["by_length"] = [
        {"before": 40.1, "after": 31.2, "batch": 16, "seq_len": 128, "predicted_drop": 0.1},
        {"before": 120.0, "after": 90.0, "batch": 1, "seq_len": 512, "predicted_drop": 0.2},
        {"before": 900.0, "after": 600.0, "batch": 1, "seq_len": 2048,
         "predicted_drop": 0.35}]
    svg = _speedup_svg(_build(r, tmp_path / "r.html").read_text("utf-8"))
    assert svg is not None
    measured = re.findall(r"<title>measured speed-up at ([\d,]+) tokens, batch (\d+): "
                          r"([\d.]+)x", svg)
    assert measured == [("128", "16", "1.285"), ("512", "1", "1.333"), ("2,048", "1", "1.5")]
    predicted = re.findall(r"<title>FLOP-predicted speed-up at ([\d,]+) tokens, batch \d+: "
                           r"([\d.]+)x", svg)
    assert predicted == [("128", "1.111"), ("512", "1.25"), ("2,048", "1.538")]
    assert svg.count("<circle") == 6
    assert "sequence length (tokens, log scale)" in svg
    assert "speed-up (latency before / after, x)" in svg


def test_speedup_chart_without_a_prediction_draws_the_measurement_only(tmp_path,
                                                                       full_results):
    r = json.loads(json.dumps(full_results))
    r["latency_ms"]["by_length"] = [
        {"before": 40.0, "after": 32.0, "batch": 16, "seq_len": 128},
        {"before": 900.0, "after": 600.0, "batch": 1, "seq_len": 2048}]
    svg = _speedup_svg(_build(r, tmp_path / "r.html").read_text("utf-8"))
    assert svg.count("<circle") == 2 and "FLOP-predicted" not in svg


@pytest.mark.parametrize("by_length", [None, []])
def test_no_speedup_chart_without_lengths(tmp_path, full_results, by_length):
    r = json.loads(json.dumps(full_results))
    r["latency_ms"]["by_length"] = by_length
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert _speedup_svg(html) is None and "Speed-up of the pruned model" not in html
    r["latency_ms"] = None
    assert _speedup_svg(_build(r, tmp_path / "r2.html").read_text("utf-8")) is None


def test_minimal_results_render(tmp_path):
    r = {"model": "m", "method": "ablation", "heads_total": 4,
         "importance": [[0.1, None], [math.nan, 0.4]]}
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert html.count("not measured") >= 10
    assert "not scored" in html and _embedded(html) == {"sample": None, "pruned": None}


_OPTIONAL_KEYS = [k for k in make_results(layers=1, heads=1, seq=2)
                  if k not in ("model", "method", "importance", "heads_total")]


@pytest.mark.parametrize("key", _OPTIONAL_KEYS)
@pytest.mark.parametrize("how", ["null", "absent"])
def test_any_optional_key_may_be_null_or_absent(tmp_path, key, how):
    r = make_results(layers=2, heads=3, seq=6)
    if how == "null":
        r[key] = None
    else:
        del r[key]
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert 'class="figure heatmap"' in html


def test_unusable_sample_is_reported_not_fatal(tmp_path, full_results):
    r = dict(full_results, sample=dict(full_results["sample"], tokens=["a", "b"]))
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert "covers 64 positions but the sample has 2 tokens" in html
    assert _embedded(html)["sample"] is None


def test_single_curve_is_drawn_under_the_method_name(tmp_path, full_results):
    r = {k: v for k, v in full_results.items() if k != "curves"}
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert re.findall(r'data-method="([^"]*)"', html) == ["michel"]
    assert "grey, dashed" not in html  # no random curve is drawn, so none is described
    assert "No <code>random</code> curve was run" in html


def test_random_curve_is_described_when_drawn(tmp_path, full_results):
    html = _build(full_results, tmp_path / "r.html").read_text("utf-8")
    assert "random" in re.findall(r'data-method="([^"]*)"', html)
    assert "<code>random</code> (grey, dashed) is the floor" in html


def test_missing_required_key_is_an_actionable_error(tmp_path):
    with pytest.raises(ValueError, match="importance"):
        _build({"model": "m", "method": "x", "heads_total": 1}, tmp_path / "r.html")


def test_write_report_rebuilds_from_results_json(tmp_path, full_results):
    (tmp_path / "results.json").write_text(json.dumps(full_results), encoding="utf-8")
    out = write_report(tmp_path)
    assert out == tmp_path / "report.html"
    assert _embedded(out.read_text("utf-8"))["sample"]["tokens"][:2] == ["The", " old"]
    with pytest.raises(FileNotFoundError, match="results.json"):
        write_report(tmp_path / "empty")


# ---------------------------------------------------------------- in the browser

@pytest.fixture(scope="module")
def browser():
    """Headless Chromium, fresh profile, every network request blocked."""
    from selenium import webdriver
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        pytest.fail("browser tests need Chromium: apt-get install -y chromium chromium-driver "
                    "(or deselect them with -m 'not browser')")
    profile = tempfile.mkdtemp(prefix="headlab-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-component-update", "--disable-sync", "--no-first-run",
                "--window-size=1280,1000", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options,
                              service=webdriver.ChromeService(executable_path=driver_path))
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*"]})
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def _open_clean(driver, path: Path) -> None:
    """Load the report and assert it fetched nothing and logged no error."""
    driver.get_log("browser")  # drop what earlier pages logged
    driver.get(path.resolve().as_uri())
    assert driver.execute_script("return performance.getEntriesByType('resource').length") == 0
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert errors == []


def _size(driver, selector: str) -> tuple[float, float]:
    return tuple(driver.execute_script(
        "const b = document.querySelector(arguments[0]).getBoundingClientRect();"
        "return [b.width, b.height];", selector))


def _drawn(driver, selector: str) -> bool:
    """True when the canvas holds at least one pixel that is neither blank nor white."""
    return driver.execute_script("""
        const c = document.querySelector(arguments[0]);
        const px = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let k = 0; k < px.length; k += 4)
          if (px[k + 3] > 0 && (px[k] < 250 || px[k + 1] < 250 || px[k + 2] < 250)) return true;
        return false;""", selector)


FIGURES = ["svg.heatmap", "svg.curve", "#gallery-grid canvas", "#explorer-canvas",
           "#explorer-left div", "#stats-table", "svg.clusters"]


@pytest.mark.browser
@pytest.mark.parametrize("kind", ["pruned", "score-only"])
def test_report_draws_every_figure_offline(browser, tmp_path, full_results, kind):
    results = full_results if kind == "pruned" else score_only(full_results)
    _open_clean(browser, _build(results, tmp_path / "report.html"))
    expected = FIGURES if kind == "pruned" else [f for f in FIGURES if f != "svg.curve"]
    for selector in expected:
        width, height = _size(browser, selector)
        assert width > 0 and height > 0, selector
    assert len(browser.find_elements("css selector", "#gallery-grid canvas")) == 144
    assert _drawn(browser, "#gallery-grid canvas") and _drawn(browser, "#explorer-canvas")
    assert len(browser.find_elements("css selector", ".head-thumb.pruned")) == (
        144 - full_results["heads_kept"] if kind == "pruned" else 0)
    if kind == "score-only":
        assert "not measured" in browser.find_element("id", "curve").text
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / f"report-{kind}.png"))


@pytest.mark.browser
def test_report_interactions(browser, tmp_path, full_results):
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    _open_clean(browser, _build(full_results, tmp_path / "report.html"))
    tokens = full_results["sample"]["tokens"]
    weights = decode_attention(full_results["sample"]["attention"])  # (L, H, S, S)

    # Enlarge layer 1, head 2: labels are the tokens; hovering a cell reads its weight.
    browser.find_elements("css selector", ".head-thumb")[12 + 2].click()
    assert browser.find_element("id", "enlarge").get_attribute("open") is not None
    labels = browser.find_elements("css selector", "#enlarge-grid .rows div")
    assert [d.get_attribute("textContent") for d in labels] == tokens
    canvas = browser.find_element("css selector", "#enlarge-grid canvas")
    width, height = _size(browser, "#enlarge-grid canvas")
    i, j = 10, 9  # query, key
    ActionChains(browser).move_to_element_with_offset(
        canvas, int((j + 0.5) * width / 64 - width / 2), int((i + 0.5) * height / 64 - height / 2)
    ).perform()
    readout = browser.find_element("id", "enlarge-readout").text
    assert readout.startswith(f"query {i} ") and f" key {j} " in readout
    assert float(readout.rsplit(" ", 1)[1]) == pytest.approx(weights[1, 2, i, j], abs=6e-4)
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "report-enlarged.png"))
    browser.find_element("id", "enlarge-close").click()

    # Explorer: another layer shows that layer's pruned heads; "none" clears the lines.
    Select(browser.find_element("id", "explorer-layer")).select_by_value("3")
    pruned = [b.text for b in browser.find_elements("css selector", "#explorer-heads .pruned")]
    kept = set(full_results["kept_heads"]["3"])
    assert pruned == [f"H{h}" for h in range(12) if h not in kept]
    browser.find_element("id", "explorer-none").click()
    assert not _drawn(browser, "#explorer-canvas")

    # Sorting by entropy puts the largest first.
    browser.find_element("css selector", "#stats-table th[data-col='2']").click()
    first = browser.find_element("css selector", "#stats-table tbody td:nth-child(3)").text
    assert float(first) == pytest.approx(max(r["entropy"] for r in full_results["statistics"]),
                                         abs=5e-4)

    # The policy itself refuses a fetch. The DevTools block would stop the request before
    # the policy sees it, so it is lifted for this one check.
    browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
    try:
        directive = browser.execute_async_script("""
            const done = arguments[0];
            document.addEventListener('securitypolicyviolation',
                                      (e) => done(e.effectiveDirective), {once: true});
            const img = document.createElement('img');
            img.src = 'https://example.com/pixel.png';
            document.body.append(img);
            setTimeout(() => done('none'), 2000);""")
    finally:
        browser.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*"]})
    assert directive == "img-src"


@pytest.mark.browser
def test_hostile_token_shows_as_text_and_runs_nothing(browser, tmp_path):
    from selenium.common.exceptions import NoAlertPresentException

    r = make_results(layers=2, heads=2, seq=8, tokens=[*sample_tokens(4), HOSTILE,
                                                       *sample_tokens(3)])
    r["model"] = r["clusters"]["names"]["0"] = HOSTILE
    _open_clean(browser, _build(r, tmp_path / "report.html"))
    with pytest.raises(NoAlertPresentException):
        browser.switch_to.alert.text  # noqa: B018 - reading it is the check
    assert browser.find_elements("css selector", "img") == []
    left = browser.find_elements("css selector", "#explorer-left div")
    assert left[4].text == HOSTILE and left[4].is_displayed()
    assert browser.find_element("css selector", "h1 .model").text == HOSTILE


def test_changes_from_a_vanishing_base_read_as_differences():
    from headlab.report._context import _change

    assert _change(-5.3e-8, 0.0847, False) == ("+0.0847", "bad")  # not +159193412.0%
    assert _change(2.0, 3.0, False) == ("+50.0%", "bad")
    assert _change(1.0, 0.9153, True) == ("-8.5%", "bad")


def test_unnormalised_importance_says_none(tmp_path):
    r = {"model": "m", "method": "taylor", "heads_total": 2, "importance": [[0.1, 0.2]],
         "importance_normalisation": None}
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert "<dt>importance normalisation</dt><dd>none</dd>" in html


def test_summary_counts_the_examples_beside_the_tokens(tmp_path):
    r = {"model": "m", "method": "michel", "heads_total": 2, "importance": [[0.1, 0.2]],
         "data": {"scoring_tokens": 8237, "heldout_tokens": 8120,
                  "scoring_examples": 354, "heldout_examples": 355}}
    html = _build(r, tmp_path / "r.html").read_text("utf-8")
    assert "<dt>tokens (scoring / held-out)</dt><dd>8,237 / 8,120</dd>" in html
    assert "<dt>examples (scoring / held-out)</dt><dd>354 / 355</dd>" in html


# ---------------------------------------------------------------- reading right (issue 37)

def _with_removal_scores(results: dict) -> tuple[dict, tuple[int, int], float]:
    """results with a three-scoring iterative schedule's removal scores: one pruned head
    scores far lower in the scoring that removed it (2) than in the first."""
    layers, heads = len(results["importance"]), len(results["importance"][0])
    kept = {int(k): set(v) for k, v in results["kept_heads"].items()}
    scores = [[v * 0.5 for v in row] for row in results["importance"]]
    scoring = [[None if h in kept[layer] else 1 for h in range(heads)]
               for layer in range(layers)]
    layer, head = next((la, h) for la in range(layers) for h in range(heads)
                       if h not in kept[la])
    scores[layer][head], scoring[layer][head] = 0.001234, 2
    return ({**results, "removal_scores": {"scores": scores, "scoring": scoring,
                                           "scorings": 3}}, (layer, head), 0.001234)


def _cell_tip(driver, figure: str, layer: int, head: int) -> str:
    return driver.execute_script(
        "return document.querySelector(arguments[0] + ` g.cell[data-layer='${arguments[1]}']"
        "[data-head='${arguments[2]}'] title`).textContent;", figure, layer, head)


@pytest.mark.browser
def test_importance_map_shows_the_scores_that_chose_each_removal(browser, tmp_path,
                                                                 full_results):
    results, (layer, head), score = _with_removal_scores(full_results)
    _open_clean(browser, _build(results, tmp_path / "report.html"))
    tip = _cell_tip(browser, "#importance", layer, head)
    assert f"michel score {score:.4g} (pruned); chosen for removal by scoring 2" in tip
    caption = browser.find_element("css selector", "#importance .caption").text
    assert "scores that chose each removal" in caption and "3 scorings" in caption
    assert "last scoring (2)" in caption
    browser.execute_script("document.getElementById('importance').scrollIntoView()")
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "report-importance.png"))


def test_removal_scores_come_from_the_scoring_before_each_step():
    from headlab.importance import HeadScores
    from headlab.schedule import ScheduleResult
    from headlab.selection import PrunePlan

    nan = math.nan
    steps = [HeadScores([[0.1, 0.9, 0.2, 0.8]], "michel"),   # removes head 0
             HeadScores([[nan, 0.7, 0.05, 0.6]], "michel"),  # removes head 2
             HeadScores([[nan, 0.4, nan, 0.3]], "michel")]   # removes head 3
    res = ScheduleResult(PrunePlan({0: [1]}, {0: [0, 2, 3]}), steps[0], [], steps)
    removal = res.removal_scores()
    assert removal.scoring == [[0, None, 1, 2]] and removal.scorings == 3
    assert removal.scores == [[0.1, 0.4, 0.05, 0.3]]  # kept head 1: the last scoring's
    back = RunResult.from_json({"model": "m", "method": "michel", "heads_total": 4,
                                "importance": [[0.1, 0.9, 0.2, 0.8]],
                                "removal_scores": removal.to_json()})
    assert back.removal_scores == removal
    assert back.to_json()["removal_scores"] == removal.to_json()


def _scale_titles(driver) -> dict[str, str]:
    return driver.execute_script("""
        const out = {};
        document.querySelectorAll('svg.heatmap').forEach((svg, i) => {
          const t = svg.querySelector('.scale-title');
          out[svg.closest('section').id + ':' + i] = t ? t.textContent : '';
        });
        return out;""")


@pytest.mark.browser
def test_every_map_states_its_quantity_and_range_and_head_types_share_one(browser, tmp_path,
                                                                          full_results):
    from headlab.report._figures import viridis

    layers, heads = len(full_results["importance"]), len(full_results["importance"][0])
    induction = [[0.1] * heads for _ in range(layers)]
    induction[0][1] = 0.014
    sink = [[0.2] * heads for _ in range(layers)]
    sink[1][1] = 0.9
    results = {**full_results, "head_types": {"induction": induction, "sink": sink}}
    _open_clean(browser, _build(results, tmp_path / "report.html"))
    titles = _scale_titles(browser)
    assert len(titles) == 3, titles
    lo = min(min(r) for r in full_results["importance"])
    assert titles["importance:0"].startswith(f"michel score, {lo:.4g} to ")
    assert titles["head-types:1"] == "induction score, 0 to 1 (fixed scale)"
    assert titles["head-types:2"] == "sink score, 0 to 1 (fixed scale)"
    # the same score has the same colour on every head-type map: the scale is 0..1
    fills = browser.execute_script("""
        return [...document.querySelectorAll('#head-types svg.heatmap')].map((svg) =>
          svg.querySelector("g.cell[data-layer='1'][data-head='1'] rect").getAttribute('fill')
        );""")
    assert fills == [viridis(0.1), viridis(0.9)]
    browser.execute_script("document.getElementById('head-types').scrollIntoView()")
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "report-head-types.png"))


@pytest.mark.browser
@pytest.mark.parametrize("kind", ["pruned", "with-everything"])
def test_the_navigation_links_every_section(browser, tmp_path, full_results, kind):
    results = full_results
    if kind == "with-everything":
        heads = len(full_results["importance"][0])
        results = {**full_results, "head_types": {"induction": [[0.5] * heads] * 12},
                   "recovery": {"method": "lsq", "tokens": 10, "seconds": 1.0},
                   "tasks": {"hellaswag": {"before": {"acc,none": 0.3},
                                           "after": {"acc,none": 0.28}}}}
    _open_clean(browser, _build(results, tmp_path / "report.html"))
    sections = browser.execute_script(
        "return [...document.querySelectorAll('main > section')].map((s) => s.id);")
    links = browser.execute_script(
        "return [...document.querySelectorAll('nav a')].map((a) => a.getAttribute('href'));")
    assert links == [f"#{s}" for s in sections]
    if kind == "with-everything":
        assert {"head-types", "recovery", "benchmarks"} <= set(sections)


def _row_labels(driver) -> list[str]:
    return [th.text for th in driver.find_elements("css selector",
                                                   "#summary table.summary tbody th")]


@pytest.mark.browser
def test_rows_and_columns_only_where_they_apply_to_the_kind(browser, tmp_path, full_results):
    _open_clean(browser, _build(full_results, tmp_path / "decoder.html"))
    columns = [th.text for th in browser.find_elements("css selector", "#stats-table th")]
    assert {"cls", "sep", "next"}.isdisjoint(columns)  # all 0.000 under a causal mask
    assert {"entropy", "first", "prev", "self"} <= set(columns)
    labels = _row_labels(browser)
    assert "key/value cache per token" in labels and "loss (held-out)" in labels

    embedding = {**full_results, "kind": "embedding", "family": "bert",
                 "quality": {"metric": "fidelity", "higher_is_better": True, "before": 1.0,
                             "after": 0.93, "loss_before": -6.1e-08, "loss_after": 0.07},
                 "kv_cache": {"unit": "head", "eval_length": 128, "max_length": 512,
                              "bytes_per_token_eval": [36864, 22118],
                              "bytes_per_token_max": [36864, 22118]}}
    _open_clean(browser, _build(embedding, tmp_path / "embedding.html"))
    labels = _row_labels(browser)
    assert not [x for x in labels if "cache" in x or "key/value" in x], labels
    assert not [x for x in labels if x.startswith("loss")], labels
    assert "-6.1e-08" not in browser.find_element("id", "summary").text
    assert labels[0] == "fidelity (held-out)"
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "report-embedding.png"))


def test_the_recovery_caption_shows_options_as_a_reader_would_write_them(full_results):
    """distill's summary options (losses, learning rates) to 4 significant digits, a
    missing one as not measured; words, counts and flags as they are."""
    from headlab.report._context import recovery_view

    options = {"start": "lsq", "ridge": 0.3, "lr": 0.0001, "loss_first": 1.2345678901,
               "loss_last": float("nan"), "steps": 32, "lora": False}
    result = RunResult.from_json({**full_results, "recovery": {
        "method": "distill", "options": options, "tokens": 4096, "seconds": 2.0,
        "layers": [], "notes": []}})
    assert recovery_view(result)["options"] == (
        "start lsq, ridge 0.3, lr 0.0001, loss_first 1.235, loss_last not measured, "
        "steps 32, lora False")


@pytest.mark.browser
def test_the_recovery_table_shows_the_mlp_fit_errors(browser, tmp_path, full_results):
    layers = [{"layer": 0, "error_before": 0.5, "error_after": 0.1,
               "mlp_error_before": 0.25, "mlp_error_after": 0.0625},
              {"layer": 1, "error_before": 0.4, "error_after": 0.2,
               "mlp_error_before": 0.125, "mlp_error_after": 0.03125}]
    results = {**full_results, "recovery": {
        "method": "lsq", "options": {"ridge": 0.01}, "tokens": 4096, "seconds": 2.0,
        "layers": layers, "notes": ["the MLP of layer 3 was not refitted: none is declared"]}}
    _open_clean(browser, _build(results, tmp_path / "report.html"))
    head = [th.text for th in browser.find_elements(
        "css selector", "table.recovery-layers thead th")]
    assert [h.lower() for h in head] == [
        "layer", "error before", "error after", "mlp error before", "mlp error after"]
    rows = [[td.text for td in tr.find_elements("css selector", "th, td")]
            for tr in browser.find_elements("css selector", "table.recovery-layers tbody tr")]
    assert rows == [["0", "0.5", "0.1", "0.25", "0.0625"], ["1", "0.4", "0.2", "0.125",
                                                             "0.03125"]]
    assert "not refitted: none is declared" in browser.find_element("id", "recovery").text


@pytest.mark.browser
def test_the_one_text_view_shows_only_what_one_text_measures(browser, tmp_path, full_results):
    from headlab.report import render

    result = RunResult.from_json({**full_results, "method": "inspect", "kept_heads": None,
                                  "curve": None, "curves": None, "files": {},
                                  "clusters": None})
    path = tmp_path / "view.html"
    path.write_text(render(result, view="text"), encoding="utf-8")
    _open_clean(browser, path)
    sections = browser.execute_script(
        "return [...document.querySelectorAll('main > section')].map((s) => s.id);")
    assert sections == ["gallery", "explorer", "statistics"]
    links = browser.execute_script(
        "return [...document.querySelectorAll('nav a')].map((a) => a.getAttribute('href'));")
    assert links == ["#gallery", "#explorer", "#statistics"]
    page = browser.find_element("tag name", "body").text
    assert "not measured" not in page and "results.json" not in page
    columns = [th.text for th in browser.find_elements("css selector", "#stats-table th")]
    assert "importance" not in columns and "cluster" not in columns
    assert len(browser.find_elements("css selector", "#gallery-grid canvas")) == 144
    ARTIFACTS.mkdir(exist_ok=True)
    browser.save_screenshot(str(ARTIFACTS / "inspect-view.png"))
    with pytest.raises(ValueError, match="view must be one of"):
        render(result, view="summary")
