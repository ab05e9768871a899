"""docs/prune-and-repair.md's tables of scripts/schedule_study.py's committed runs
(``reports/bench/schedule-study/*.json``, judged on calibration articles alone): the gate
trainings studied, between ``<!-- gates-budget:start -->`` and ``<!-- gates-budget:end -->``,
and the candidates for the default method, each as `headlab prune` runs it unless told
otherwise, over its seeds, between ``<!-- default-study:start -->`` and
``<!-- default-study:end -->``. scripts/bench_tables.py writes and checks them with its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from schedule_study import gates_options, taylor_options  # noqa: E402

from headlab.runs.config import DEFAULT_METHOD, RunConfig  # noqa: E402
from headlab.schedule import default_schedule  # noqa: E402

GATES_MARKERS = ("<!-- gates-budget:start -->", "<!-- gates-budget:end -->")
DEFAULT_MARKERS = ("<!-- default-study:start -->", "<!-- default-study:end -->")
# <model>.json (taylor's schedules and probes) and gates-<model>.json (gate trainings)
GATES_STUDIES = ROOT / "reports" / "bench" / "schedule-study"


def gates_variant(variant: str) -> tuple[str, str, int]:
    """A schedule_study gates variant
    (``gates:STEPS:LR[:RATE|:projection][:token][:bN][:sN]``) as (the training, its
    ``--gate-budget``, its seed): the variants that differ in the seed alone are one
    training."""
    o = gates_options(variant)
    rate = "" if o["gate_lagrange_lr"] is None else f", multipliers at {o['gate_lagrange_lr']}"
    b = o["gate_batch"]
    per_step = "" if b is None else f", {b} block{'' if b == 1 else 's'} a step"
    per_token = ", a draw per token" if o["gate_sample"] == "token" else ""
    return (f"{o['gate_steps']} steps at lr {o['gate_lr']}{rate}{per_step}{per_token}",
            o["gate_budget"], o["seed"])


def _mean(rs: list[dict], key: str) -> float:
    return sum(r[key] for r in rs) / len(rs)


def _cell(rs: list[dict], key: str) -> str:
    """The mean over the seeds' rows, and each seed's beside it."""
    each = "" if len(rs) == 1 else f" ({', '.join(f'{r[key]:.1f}' for r in rs)})"
    return f"{_mean(rs, key):.1f}{each}"


def _gates_study(studies: list[dict]) -> list[str]:
    """The gate trainings studied, per model: each training's seeds, where the expected
    number of open gates ended and the perplexity pruned and after lsq (the means over
    the seeds; each seed's perplexity in brackets), and its mean seconds."""
    rows = ["| model (perplexity as it came) | gates trained | `--gate-budget` | seeds | "
            "expected open (target) | pruned | after `lsq` | seconds |",
            "|---|---|---|---|---|---|---|---|"]
    for run in studies:
        trainings: dict[tuple[str, str], list[tuple[int, dict]]] = {}  # -> (seed, row)
        for r in run["rows"]:
            if r["variant"].startswith("gates:"):
                training, budget, seed = gates_variant(r["variant"])
                trainings.setdefault((training, budget), []).append((seed, r))
        name = f"{run['model']} ({run['before']:.1f})"
        for (training, budget), seeded in trainings.items():
            rs = [r for _, r in seeded]
            rows.append(f"| {name} | {training} | `{budget}` | "
                        f"{', '.join(str(s) for s, _ in seeded)} | "
                        f"{_mean(rs, 'expected_open'):.1f} ({run['target']}) | "
                        f"{_cell(rs, 'pruned')} | {_cell(rs, 'lsq')} | "
                        f"{_mean(rs, 'score_s'):.0f} |")
            name = ""
    return rows


def render_gates_study(_paths: list[Path]) -> str:
    """docs/prune-and-repair.md's block: the committed gate-training studies."""
    studies = [json.loads(p.read_text()) for p in sorted(GATES_STUDIES.glob("gates-*.json"))]
    body = ("\n".join(_gates_study(studies)) if studies
            else "No gate training studied (scripts/schedule_study.py writes them).")
    return f"{GATES_MARKERS[0]}\n{body}\n{GATES_MARKERS[1]}"


def default_seed(variant: str, method: str) -> int | None:
    """The seed of a schedule_study variant that runs ``method`` (taylor or gates) as
    ``headlab prune`` does by default (RunConfig's schedule, step and probes, or its
    gate training), None for any other variant."""
    cfg = RunConfig("any")
    is_gates = variant.startswith("gates:")
    if method == "gates" and is_gates:
        o = gates_options(variant)
        given = (o["gate_steps"], o["gate_lr"], o["gate_budget"], o["gate_lagrange_lr"],
                 o["gate_batch"], o["gate_sample"])
        default = (cfg.gate_steps, cfg.gate_lr, cfg.gate_budget, cfg.gate_lagrange_lr,
                   cfg.gate_batch, cfg.gate_sample)
        return o["seed"] if given == default else None
    if method == "taylor" and not is_gates:
        o = taylor_options(variant)
        given = (o["schedule"], o["step"], o["probes"])
        return o["seed"] if given == (default_schedule("taylor"), cfg.step,
                                      cfg.probes) else None
    return None


def _default_study(studies: list[tuple[dict, dict]]) -> list[str]:
    """Per model, taylor and the gates as `headlab prune` runs each by default: the
    perplexity pruned and after lsq (the means over the seeds, each seed's beside it),
    and the mean seconds of the scoring (taylor's schedule) or training (the gates')."""
    cfg = RunConfig("any")
    how = {"taylor": f"{default_schedule('taylor')}, steps of {cfg.step}, {cfg.probes} probes",
           "gates": f"{default_schedule('gates')}, {cfg.gate_steps} steps at lr {cfg.gate_lr}, "
                    f"{cfg.gate_batch} block{'' if cfg.gate_batch == 1 else 's'} a step, "
                    f"`{cfg.gate_budget}`"}
    rows = ["| model (perplexity as it came) | method, as `headlab prune` runs it | seeds | "
            "pruned | after `lsq` | seconds |", "|---|---|---|---|---|---|"]
    for schedules, gates in studies:
        name = f"{schedules['model']} ({schedules['before']:.1f})"
        for method, run in (("taylor", schedules), ("gates", gates)):
            seeded = sorted(((s, r) for r in run["rows"]
                             if (s := default_seed(r["variant"], method)) is not None),
                            key=lambda seed_row: seed_row[0])
            if not seeded:
                continue
            rs = [r for _, r in seeded]
            default = " (the default)" if method == DEFAULT_METHOD else ""
            rows.append(f"| {name} | `{method}`{default}: {how[method]} | "
                        f"{', '.join(str(s) for s, _ in seeded)} | {_cell(rs, 'pruned')} | "
                        f"{_cell(rs, 'lsq')} | {_mean(rs, 'score_s'):.0f} |")
            name = ""
    return rows


def render_default_study(_paths: list[Path]) -> str:
    """docs/prune-and-repair.md's block: the default's candidates, from the committed
    studies of the models that have both (``<model>.json`` and ``gates-<model>.json``)."""
    studies = [(json.loads(p.read_text()), json.loads(gates.read_text()))
               for p in sorted(GATES_STUDIES.glob("*.json"))
               if not p.name.startswith("gates-")
               and (gates := p.with_name(f"gates-{p.name}")).exists()]
    body = ("\n".join(_default_study(studies)) if studies
            else "No candidates studied (scripts/schedule_study.py writes them).")
    return f"{DEFAULT_MARKERS[0]}\n{body}\n{DEFAULT_MARKERS[1]}"
