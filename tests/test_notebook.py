"""recipes/explore-heads.ipynb: stored clean, and runs top to bottom with its key outputs."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

NOTEBOOK = Path(__file__).resolve().parents[1] / "recipes" / "explore-heads.ipynb"


def _cell(nb, snippet: str):
    """The one code cell whose source contains ``snippet``."""
    found = [c for c in nb.cells if c.cell_type == "code" and snippet in c.source]
    assert len(found) == 1, f"expected one code cell with {snippet!r}, found {len(found)}"
    return found[0]


def _html(cell) -> str:
    return "".join(o["data"]["text/html"] for o in cell.outputs
                   if o.output_type in ("execute_result", "display_data")
                   and "text/html" in o.get("data", {}))


def _stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")


def test_notebook_is_stored_valid_and_clean():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    assert nb.nbformat == 4 and nb.metadata.kernelspec.name == "python3"
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.slow
def test_notebook_runs(tmp_path):
    from nbclient import NotebookClient

    nb = nbformat.read(NOTEBOOK, as_version=4)
    # cells raising stop the run with CellExecutionError, naming the cell
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors

    assert "headlab Capture" in _html(_cell(nb, "headlab.capture(model"))
    views = [c for c in nb.cells if c.cell_type == "code" and "viz.attention_html(" in c.source]
    assert len(views) == 2  # before and after pruning
    for view in views:
        frame = _html(view)
        assert frame.startswith("<iframe srcdoc=") and "https://" not in frame
    assert 'id="bertviz-' in _html(_cell(nb, "viz.head_view("))
    table = _html(_cell(nb, "viz.inspect_text("))
    assert "<table" in table and "prev" in table and "entropy" in table
    assert "<table" in _html(_cell(nb, "headlab.score("))

    out = _stdout(_cell(nb, "headlab.prune("))
    before = re.search(r"before: (\d+\.\d+)", out)
    after = re.search(r"after: +(\d+\.\d+)", out)
    assert before and after, out
    before, after = float(before.group(1)), float(after.group(1))
    # fidelity: cosine to the unpruned model's embeddings, so 1 before pruning
    assert before == pytest.approx(1.0, abs=1e-4)
    assert 0.0 < after < before
    assert "heads kept: 36 of 72" in out
