"""The HTML report of a run: one self-contained file that opens anywhere, offline.

Everything the page needs is inside it: the project's own CSS and JS inline, figures
as inline SVG, and the attention sample as JSON in one <script type="application/json">.
A Content-Security-Policy lets only that script run and forbids every fetch, so the
report cannot reach the network even if a token in the data were hostile.

The report is rebuilt from results.json alone; it never re-runs a model.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from headlab._util.io import atomic_write_text
from headlab.errors import UserError
from headlab.results import RunResult

from . import _benchmarks, _context

if TYPE_CHECKING:
    from headlab.analysis.attribution import LogitAttribution
from ._encoding import decode_attention, encode_attention, script_json

__all__ = ["build_report", "decode_attention", "encode_attention", "render", "write_report"]

_HERE = Path(__file__).parent


def build_report(result: RunResult, out_path: str | Path) -> Path:
    """Render ``result`` to a standalone HTML file (written atomically); returns its path."""
    return atomic_write_text(out_path, render(result))


def write_report(run_dir: str | Path) -> Path:
    """Rebuild RUN_DIR/report.html from RUN_DIR/results.json (what `headlab report` runs)."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; RUN_DIR must be a directory written by "
                                "`headlab prune` or `headlab run`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path} is not valid JSON ({exc}); rerun the run or restore the "
                        "file") from exc
    except RecursionError:
        raise UserError(f"{path} nests deeper than JSON readers go; rerun the run or restore "
                        "the file") from None
    return build_report(RunResult.from_json(data), path.parent / "report.html")


VIEWS = ("run", "text")


def render(result: RunResult, *, view: str = "run",
           attribution: LogitAttribution | None = None) -> str:
    """The page as one string: inline CSS and JS, the policy, the data block, the figures.

    ``view="run"`` is a run's report; ``view="text"`` the view of one text's attention
    (`headlab.viz`): its attention maps, explorer and per-head statistics, without the
    run's sections (quality, importance, curve, files), which it never measured, and
    with ``attribution`` (a `headlab.analysis.attribution.LogitAttribution` of the same
    text) its per-head direct logit attribution."""
    if view not in VIEWS:
        raise ValueError(f"view must be one of {', '.join(VIEWS)}, got {view!r}")
    if attribution is not None and view != "text":
        raise ValueError("attribution belongs to the one-text view (view='text')")
    js = (_HERE / "report.js").read_text(encoding="utf-8")
    css = (_HERE / "report.css").read_text(encoding="utf-8")
    if "</" in js or "</" in css:
        raise RuntimeError("report.js/report.css must not contain '</': it would end the "
                           "inline element early")
    # The policy names the one script by hash, so injected inline code could not run.
    script_hash = base64.b64encode(hashlib.sha256(js.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{script_hash}'; "
           "style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'")

    mask = _context.pruned_mask(result)
    facts = _context.run_facts(result)
    sample, sample_note = _context.sample_view(result)
    data = {"sample": sample, "pruned": mask}
    env = Environment(loader=FileSystemLoader(_HERE), autoescape=True,
                      undefined=StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return env.get_template("template.html").render(
        r=result,
        view=view,
        importance_caption=_context.importance_caption(result),
        csp=csp,
        css=Markup(css),
        js=Markup(js),
        data_json=Markup(script_json(data)),
        facts=facts,
        keep_text=None if facts["keep"] == _context.NOT_MEASURED else facts["keep"],
        normalisation=result.importance_normalisation,
        warning=result.data.warning,
        score_only=mask is None,
        summary=_context.summary_rows(result),
        recovery=_context.recovery_view(result),
        benchmarks=_benchmarks.benchmarks_view(result),
        per_layer=_context.per_layer_rows(result),
        config=_context.config_rows(result.config),
        figures=_context.figures(result, mask),
        random_curve="random" in _context.run_curves(result),
        cluster_method=result.clusters.method if result.clusters else None,
        stats=_context.statistics_table(result, mask, with_importance=view == "run"),
        head_types=_context.head_types_view(result, mask),
        type_threshold=_context.HEAD_TYPE_THRESHOLD,
        files=_context.file_links(result),
        sample=sample,
        sample_note=sample_note,
        not_measured=_context.NOT_MEASURED,
        # the attribution's own map: its text is escaped where it is built
        attribution=Markup(attribution._repr_html_()) if attribution is not None else None,
    )
