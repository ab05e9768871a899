"""Every Python and shell block of README.md and docs/*.md runs here, as a reader would
paste it.

A block runs alone: Python blocks in a fresh namespace, shell blocks line by line (a
line ending in ``\\`` continues on the next) with this checkout's ``headlab`` and
``python`` first on PATH; both in an empty temporary directory unless told otherwise.
A line whose comment starts with ``exit N`` must exit with N (``# exit 2: ...``), every
other line with 0. An HTML comment on the line just before a block's fence says how
it runs, directives separated by ``;``:

    <!-- skip: REASON -->   not run; pytest -ra prints REASON (the whole rest)
    <!-- slow -->           more than about 20 s on two cores: under the ``slow`` marker
    <!-- cwd: repo -->      run in the repository root, not in a temporary directory

The benchmark tables of docs/benchmarks.md are checked against what
scripts/bench_tables.py writes from the committed reports/bench/*.json.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from _scripts import script

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELLS = ("bash", "sh", "shell")
_FENCE = re.compile(r"^(`{3,})\s*([\w+-]*)")
_DIRECTIVE = re.compile(r"^<!--(.*)-->\s*$")
_EXIT = re.compile(r"#\s*exit (\d+)\b")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    skip: str | None = None
    slow: bool = False
    in_repo: bool = False

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    """The fenced blocks of a Markdown page with the directives just before each."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i].strip())
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        code = "\n".join(lines[start + 1:j])
        skip, slow, in_repo = None, False, False
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        d = _DIRECTIVE.match(lines[before].strip()) if before >= 0 else None
        text = d.group(1).strip() if d else ""
        if text.startswith("skip:"):  # the reason is the rest, semicolons included
            skip = text[len("skip:"):].strip()
        elif d:
            for part in (p.strip() for p in text.split(";")):
                if part == "slow":
                    slow = True
                elif part == "cwd: repo":
                    in_repo = True
                elif part.startswith(("capabilities:", "bench:")):
                    pass  # the generated tables' markers
                else:
                    raise ValueError(f"{page}:{before + 1}: unknown directive {part!r}")
        out.append(Block(page, start + 1, lang, code, skip, slow, in_repo))
        i = j + 1
    return out


def _params() -> list:
    params = []
    for page in PAGES:
        for b in blocks_of(page):
            if b.lang != "python" and b.lang not in SHELLS:
                continue
            marks = [pytest.mark.slow] if b.slow else []
            params.append(pytest.param(b, id=b.id, marks=marks))
    return params


def shell_lines(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    commands, current = [], ""
    for raw in code.splitlines():
        line = raw.rstrip()
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            current += line[:-1].strip() + " "
            continue
        commands.append(current + (line.strip() if current else line))
        current = ""
    assert not current, f"a shell block ends inside a continued line: {current!r}"
    return commands


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


@pytest.mark.parametrize("block", _params())
def test_block_runs(block: Block, tmp_path, monkeypatch):
    if block.skip:
        pytest.skip(block.skip)
    cwd = ROOT if block.in_repo else tmp_path
    if block.lang == "python":
        monkeypatch.chdir(cwd)
        code = compile(block.code, block.id, "exec")
        exec(code, {"__name__": "__docs__"})
        return
    for command in shell_lines(block.code):
        m = _EXIT.search(command)
        expected = int(m.group(1)) if m else 0
        done = subprocess.run(["bash", "-c", command], cwd=cwd, env=_env(), text=True,
                              capture_output=True, timeout=1800)
        assert done.returncode == expected, (
            f"{block.id}: `{command}` exited {done.returncode}, expected {expected}\n"
            f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}")


def test_every_page_has_a_runnable_or_explained_block():
    """The collector sees the blocks: each page with code holds python or shell ones."""
    langs = {b.lang for page in PAGES for b in blocks_of(page)}
    assert "python" in langs and "bash" in langs


def test_shell_lines_join_continuations_and_drop_comments():
    code = "# a comment\nheadlab a \\\n  --b 1\n\nheadlab c  # exit 2: why\n"
    assert shell_lines(code) == ["headlab a --b 1", "headlab c  # exit 2: why"]
    assert _EXIT.search(shell_lines(code)[1]).group(1) == "2"


def test_directives_are_read(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("text\n<!-- skip: needs the hub -->\n```bash\nheadlab x\n```\n\n"
                    "<!-- slow; cwd: repo -->\n\n```python\nprint(1)\n```\n```text\nout\n```\n")
    a, b, c = blocks_of(page)
    assert (a.lang, a.skip, a.slow, a.line) == ("bash", "needs the hub", False, 3)
    assert (b.lang, b.skip, b.slow, b.in_repo, b.code) == ("python", None, True, True,
                                                           "print(1)")
    assert (c.lang, c.skip) == ("text", None)
    page.write_text("<!-- slwo -->\n```bash\nx\n```\n")
    with pytest.raises(ValueError, match="unknown directive"):
        blocks_of(page)


def test_mkdocs_nav_lists_every_page():
    """A page missing from mkdocs.yml's nav would build but never be linked."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(entries):
        for e in entries:
            v = next(iter(e.values())) if isinstance(e, dict) else e
            yield from (files(v) if isinstance(v, list) else [v])

    assert sorted(files(nav)) == sorted(p.name for p in (ROOT / "docs").glob("*.md"))


def test_benchmark_tables_are_the_committed_jsons():
    """docs/benchmarks.md's tables are what the script writes from reports/bench/*.json;
    after a bench run, ``python scripts/bench_tables.py`` rewrites them."""
    tables = script("bench_tables")
    jsons = sorted((ROOT / "reports" / "bench").glob("*.json"))
    assert jsons, "no reports/bench/*.json committed"
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert tables.current_block(page) == tables.render(jsons), (
        "docs/benchmarks.md's tables are stale: run python scripts/bench_tables.py")
    readme = (ROOT / "README.md").read_text()
    assert tables.current_block(readme, tables.TRADEOFF_MARKERS) == tables.render_tradeoff(
        jsons), "the README's trade-off table is stale: run python scripts/bench_tables.py"
    kv_cache = (ROOT / "docs" / "kv-cache.md").read_text()
    assert tables.current_block(kv_cache, tables.KV_MARKERS) == tables.render_kv_cache(
        jsons), "docs/kv-cache.md's tables are stale: run python scripts/bench_tables.py"
    methods = (ROOT / "docs" / "prune-and-repair.md").read_text()
    assert tables.current_block(methods, tables.METHOD_MARKERS) == tables.render_methods(
        jsons), "docs/prune-and-repair.md's table of methods is stale: run " \
        "python scripts/bench_tables.py"
    assert tables.current_block(methods, tables.GATES_MARKERS) == tables.render_gates_study(
        jsons), "docs/prune-and-repair.md's table of gate trainings is stale: run " \
        "python scripts/bench_tables.py"
    assert tables.current_block(methods, tables.DEFAULT_MARKERS) == \
        tables.render_default_study(jsons), "docs/prune-and-repair.md's table of the " \
        "default's candidates is stale: run python scripts/bench_tables.py"


def test_bench_tables_script_rewrites_and_checks(tmp_path):
    tables = script("bench_tables")
    page = tmp_path / "benchmarks.md"
    start, end = tables.MARKERS
    page.write_text(f"before\n{start}\nold\n{end}\nafter\n")
    readme = tmp_path / "README.md"
    readme.write_text("intro\n{}\nold\n{}\n".format(*tables.TRADEOFF_MARKERS))
    jsons = sorted((ROOT / "reports" / "bench").glob("*.json"))
    kv_cache = tmp_path / "kv-cache.md"
    kv_cache.write_text("{}\nold\n{}\nend\n".format(*tables.KV_MARKERS))
    methods = tmp_path / "prune-and-repair.md"
    methods.write_text("{}\nold\n{}\n{}\nold\n{}\n{}\nold\n{}\n".format(
        *tables.METHOD_MARKERS, *tables.GATES_MARKERS, *tables.DEFAULT_MARKERS))
    args = ["--readme", str(readme), "--kv-cache", str(kv_cache), "--methods", str(methods),
            *map(str, jsons)]
    assert tables.main([str(page), *args]) == 0
    text = page.read_text()
    assert text.startswith("before\n") and text.endswith("\nafter\n")
    assert tables.current_block(text) == tables.render(jsons)
    assert readme.read_text() == f"intro\n{tables.render_tradeoff(jsons)}\n"
    assert kv_cache.read_text() == f"{tables.render_kv_cache(jsons)}\nend\n"
    assert methods.read_text() == (f"{tables.render_methods(jsons)}\n"
                                   f"{tables.render_gates_study(jsons)}\n"
                                   f"{tables.render_default_study(jsons)}\n")
    assert "**" in methods.read_text()  # quality.json's grids: the best after lsq marked
    assert tables.main([str(page), "--check", *args]) == 0
    page.write_text(text.replace("| yes |", "| no |", 1).replace("| **no** |", "| x |", 1))
    assert tables.main([str(page), "--check", *args]) == 1


def test_count_table_counts_least_geometric_mean_and_worst_of_each_score():
    """Two models, one keep: taylor least in one cell, gates 2x and 1/2x it."""
    tables = script("bench_tables")

    def grid(lost: dict[str, float], seconds: dict[str, float]) -> dict:
        rows = [{"method": m, "repair": "lsq", "lost": [x]} for m, x in lost.items()]
        return {"keeps": [0.6], "rows": rows, "seconds": seconds}

    grids = [("a", grid({"taylor": 1.0, "gates": 2.0, "michel_unnormalised": 4.0,
                         "michel": 4.0}, {"michel": 10.0, "taylor": 20.0, "gates": 5.0})),
             ("b", grid({"taylor": 2.0, "gates": 1.0, "michel_unnormalised": 2.0,
                         "michel": 8.0}, {"michel": 10.0, "taylor": 30.0, "gates": 40.0}))]
    rows = {r.split(" | ")[0]: r for r in tables._counts(grids) if r.startswith("| `")}
    assert rows["| `taylor`"] == "| `taylor` | 1 of 2 | 1.41x | 2.00x (b, keep 0.6) | 2.0, 3.0 |"
    assert rows["| `gates`"] == "| `gates` | 1 of 2 | 1.41x | 2.00x (a, keep 0.6) | 0.5, 4.0 |"
    assert rows["| `michel`"].startswith("| `michel` | 0 of 2 | 5.66x | 8.00x (b, keep 0.6)")
    assert "michel's pass" in rows["| `michel --no-normalize`"]


def test_shell_quoting_in_blocks_is_bash():
    """Each shell command is handed to bash whole; one that shlex cannot split is a typo."""
    for page in PAGES:
        for b in blocks_of(page):
            if b.lang in SHELLS and not b.skip:
                for command in shell_lines(b.code):
                    shlex.split(command, comments=True)


def _code_lines(code: str) -> int:
    return sum(1 for line in code.splitlines()
               if line.strip() and not line.strip().startswith("#"))


def _task_lines(code: str) -> int:
    """Lines of code from the one marked ``# 1.`` to the end, less the final print."""
    lines = code.splitlines()
    start = next(i for i, line in enumerate(lines) if "# 1." in line)
    return _code_lines("\n".join(lines[start:])) - 1


def test_interpretability_example_is_no_longer_than_transformerlens():
    """docs/python-api.md states the line counts of its headlab and TransformerLens
    versions of the five tasks; they are the blocks' own, headlab's no more."""
    page = ROOT / "docs" / "python-api.md"
    text = page.read_text()
    section = text[text.index("## Interpretability in ten lines"):
                   text.index("## The attention module")]
    blocks = [b for b in blocks_of(page) if b.lang == "python" and "# 1." in b.code]
    ours = next(b for b in blocks if "transformer_lens" not in b.code)
    theirs = next(b for b in blocks if "transformer_lens" in b.code)
    assert ours.skip is None and theirs.skip
    counts = re.search(r"headlab (\d+) lines, TransformerLens (\d+); the five tasks "
                       r"themselves \(from\s+the capture to the patch\) take (\d+) lines with "
                       r"headlab and (\d+) with TransformerLens", section)
    assert counts, "the section states both counts"
    stated = [int(g) for g in counts.groups()]
    assert stated == [_code_lines(ours.code), _code_lines(theirs.code),
                      _task_lines(ours.code), _task_lines(theirs.code)]
    assert stated[0] <= stated[1] and stated[2] <= stated[3] and stated[2] <= 10


def test_the_documented_default_method_is_the_runs_and_its_evidence_is_committed():
    """The importance-method table marks one default, the one a run uses; the table of
    methods that chose it is quality.json's (test_benchmark_tables_are_the_committed_jsons),
    measured on the schedule a run uses, with the default's column the run's method."""
    import json

    from headlab.runs.config import DEFAULT_METHOD, RunConfig

    page = (ROOT / "docs" / "prune-and-repair.md").read_text()
    marked = re.findall(r"^\| `(\w+)` \(default\) \|", page, flags=re.M)
    assert marked == [DEFAULT_METHOD]
    run = json.loads((ROOT / "reports" / "bench" / "quality.json").read_text())
    assert run["config"]["step"] == RunConfig.step, "chosen on the schedule a run uses"
    columns = script("bench_tables").METHOD_COLUMNS
    assert [m for m, name in columns.items() if name.endswith("(default)")] == [
        DEFAULT_METHOD]
    for key, grid in run["checks"].items():
        if key.endswith(".grid"):
            assert {r["method"] for r in grid["rows"]} == set(columns), key


def test_the_gate_trainings_table_reads_the_committed_studies():
    """docs/prune-and-repair.md's table of gate trainings: one row per training of each
    committed scripts/schedule_study.py run, its seeds gathered, the means theirs."""
    import json

    tables = script("study_tables")
    assert tables.gates_variant("gates:100:0.1") == ("100 steps at lr 0.1", "lagrangian", 0)
    assert tables.gates_variant("gates:100:0.1:1.0:s2") == (
        "100 steps at lr 0.1, multipliers at 1.0", "lagrangian", 2)
    assert tables.gates_variant("gates:25:0.4:projection:b1:s1") == (
        "25 steps at lr 0.4, 1 block a step", "projection", 1)
    runs = sorted(tables.GATES_STUDIES.glob("gates-*.json"))
    assert [p.stem for p in runs] == ["gates-gemma3-270m", "gates-smollm2-135m"]
    lines = [ln for ln in tables.render_gates_study([]).splitlines() if ln.startswith("| ")]
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines[1:]]
    for run in (json.loads(p.read_text()) for p in runs):
        assert run["keep"] == 0.6 and run["score_tokens"] == 4096, run["model"]
        for r in run["rows"]:
            training, budget, seed = tables.gates_variant(r["variant"])
            (row,) = [c for c in cells if c[1:3] == [training, f"`{budget}`"]
                      and str(seed) in c[3].split(", ") and f"{r['lsq']:.1f}" in c[6]]
            assert row[4].endswith(f"({run['target']})"), row


def test_the_default_candidates_table_holds_each_method_as_prune_runs_it():
    """docs/prune-and-repair.md's table of the default's candidates: taylor's rows and the
    gates' are the committed studies' runs of each with `headlab prune`'s defaults, every
    seed of them and no other run, judged on the same windows (the same perplexity as
    the model came)."""
    import json

    tables = script("study_tables")
    assert tables.default_seed("iterative:0.1:4", "taylor") == 0
    assert tables.default_seed("iterative:0.1:4:s2", "taylor") == 2
    assert tables.default_seed("iterative:0.1:1", "taylor") is None  # not the default probes
    assert tables.default_seed("one-shot:0.1:4", "taylor") is None
    assert tables.default_seed("gates:100:0.1:projection:b1:s1", "gates") == 1
    assert tables.default_seed("gates:100:0.1:b1", "gates") is None  # the Lagrangian
    assert tables.default_seed("gates:100:0.1:projection:b4", "gates") is None
    assert tables.default_seed("gates:100:0.1:projection:b1", "taylor") is None
    lines = [ln for ln in tables.render_default_study([]).splitlines() if ln.startswith("| ")]
    table, model = {}, None  # (model's cell, method) -> the row's cells
    for ln in lines[1:]:  # below the header
        cells = [c.strip() for c in ln.strip("|").split("|")]
        model = cells[0] or model
        table[model, cells[1].split("`")[1]] = cells
    studied = 0
    for path in sorted(tables.GATES_STUDIES.glob("gates-*.json")):
        schedules = path.with_name(path.name.removeprefix("gates-"))
        if not schedules.exists():
            continue
        runs = {"taylor": json.loads(schedules.read_text()),
                "gates": json.loads(path.read_text())}
        assert runs["taylor"]["before"] == pytest.approx(runs["gates"]["before"], rel=1e-9)
        for method, run in runs.items():
            rows = [r for r in run["rows"] if tables.default_seed(r["variant"], method)
                    is not None]
            row = table.pop((f"{run['model']} ({run['before']:.1f})", method))
            assert row[2] == ", ".join(sorted(str(tables.default_seed(r["variant"], method))
                                              for r in rows)), row
            mean = sum(r["lsq"] for r in rows) / len(rows)
            assert row[4].startswith(f"{mean:.1f}") and len(rows) >= 3, (method, row)
            studied += 1
    assert studied == 4 and not table  # taylor and the gates on both decoders, no other
