"""The run behind docs/prune-and-repair.md's tables of schedules and probes and of gate
training: how often taylor re-scores (``--schedule``, ``--step``) and how many curvature
probes it draws (``--probes``), or how the learned gates train, against the held-out
perplexity after pruning to keep 0.6 and after ``lsq``, and the seconds each takes.
Judged on the calibration articles alone, never the evaluation ones, so the choice of
defaults it informs does not tune to the text that measures them: the first
``--score-tokens`` of a seeded sample of calibration windows score and repair, the rest
of the sample judges.

    python scripts/schedule_study.py OUT.json smollm2-135m

Each variant is a schedule, a step and a number of taylor's probes, written
``one-shot:0.1:4`` or ``iterative:0.1:4`` (``iterative:0.1:4:s1``: the probes drawn from
seed 1, not 0), or gates trained for a number of steps at a
learning rate, the multipliers at their own if given: ``gates:100:0.1`` or
``gates:100:0.1:1.0``, or held on the target by projection: ``gates:100:0.1:projection``,
each step on another number of blocks than the default and the gates' noise drawn from
another seed than 0 if last fields say so: ``gates:100:0.1:projection:b4:s2``, and
drawn per token rather than per block with ``token`` after the budget:
``gates:100:0.1:projection:token:s1``
(``--variants`` takes several, comma-separated). Gates keep the heads
whose gates end most open, once (`headlab.select`), and their row says where the expected
number of open gates ended. Run it on an idle machine without OMP_WAIT_POLICY=PASSIVE, as
the benchmarks are.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DEFAULT_VARIANTS = ("one-shot:0.1:1", "one-shot:0.1:4", "iterative:0.2:1", "iterative:0.2:4",
                    "iterative:0.1:1", "iterative:0.1:4", "iterative:0.05:1")


def _tail(fields: list[str]) -> dict[str, int]:
    """The trailing ``bN`` (blocks per step) and ``sN`` (seed) fields, popped from
    ``fields``: {"b": N, "s": N}, each where given."""
    tail = {}
    while fields and fields[-1][:1] in ("b", "s") and fields[-1][1:].isdigit():
        field = fields.pop()
        tail[field[0]] = int(field[1:])
    return tail


def taylor_options(variant: str) -> dict:
    """A taylor variant, ``SCHEDULE:STEP:PROBES[:sN]``, as ``schedule``, ``step``,
    ``probes`` and ``seed`` (that of the curvature probes, 0 unless given)."""
    schedule, *fields = variant.split(":")
    seed = _tail(fields).get("s", 0)
    step, probes = fields
    return {"schedule": schedule, "step": float(step), "probes": int(probes), "seed": seed}


def gates_options(variant: str) -> dict:
    """A gates variant, ``gates:STEPS:LR[:RATE|:projection][:token][:bN][:sN]``, as the
    options of headlab.score: ``gate_steps``, ``gate_lr``, ``gate_budget``,
    ``gate_lagrange_lr`` (None: ``gate_lr``), ``gate_batch`` (None: the default),
    ``gate_sample`` and ``seed``."""
    _, steps, lr, *rest = variant.split(":")
    tail = _tail(rest)
    per = "token" if rest[-1:] == ["token"] else "block"
    rest = rest[:-1] if per == "token" else rest
    projection = rest == ["projection"]
    return {"gate_steps": int(steps), "gate_lr": float(lr),
            "gate_budget": "projection" if projection else "lagrangian",
            "gate_lagrange_lr": float(rest[0]) if rest and not projection else None,
            "gate_batch": tail.get("b"), "gate_sample": per, "seed": tail.get("s", 0)}


def study(name: str, variants: list[str], *, seq_len: int = 128, score_tokens: int = 4096,
          judge_tokens: int = 8192, keep: float = 0.6, batch_size: int = 4) -> dict:
    """``{"model", "before", "rows": [{"variant", "pruned", "lsq", "score_s", "lsq_s",
    "scorings"}]}``: perplexity on the judging windows as the model came, after pruning
    with each variant, and after ``lsq`` fitted on the scoring windows; gates' rows add
    ``expected_open``."""
    import headlab
    from headlab.bench._data import scoring_and_heldout
    from headlab.pruning import copy_model
    from headlab.selection import heads_to_keep

    model = headlab.load(name)
    calib, _ = scoring_and_heldout(model, "enwiki", seq_len=seq_len,
                                   max_tokens=score_tokens + judge_tokens, batch_size=batch_size)
    n_score = score_tokens // seq_len
    if len(calib) <= n_score:
        raise SystemExit(f"{name}: {len(calib)} windows, too few to judge beyond the "
                         f"{n_score} that score")
    scoring = calib.subset(list(range(n_score)))
    judging = calib.subset(list(range(n_score, len(calib))))
    n_keep = heads_to_keep(model.n_layers * model.n_original_heads, keep=keep)
    before = headlab.evaluate(model, judging, batch_size=batch_size).value
    rows = []
    for variant in variants:
        t0 = time.perf_counter()
        if variant.startswith("gates:"):
            given = {k: v for k, v in gates_options(variant).items() if v is not None}
            scores = headlab.score(model, scoring, method="gates", batch_size=batch_size,
                                   target=n_keep, **given)
            plan, scorings = headlab.select(scores, n_keep), 1
            trained = {"expected_open": scores.extra["expected_open"]}
        else:
            o = taylor_options(variant)
            # the schedule's own curve is not read: one window keeps its evaluations cheap
            r = headlab.prune_to_target(model, scoring, judging.subset([0]), method="taylor",
                                        n_keep=n_keep, schedule=o["schedule"], step=o["step"],
                                        batch_size=batch_size, seed=o["seed"],
                                        score_kwargs={"probes": o["probes"]})
            plan, scorings, trained = r.plan_at(n_keep), len(r.step_scores), {}
        score_s = time.perf_counter() - t0
        pruned = headlab.prune(copy_model(model), plan)
        after = headlab.evaluate(pruned, judging, batch_size=batch_size).value
        t0 = time.perf_counter()
        headlab.recover(pruned, model, scoring, method="lsq", batch_size=batch_size)
        lsq_s = time.perf_counter() - t0
        rows.append({"variant": variant, "pruned": after,
                     "lsq": headlab.evaluate(pruned, judging, batch_size=batch_size).value,
                     "score_s": score_s, "lsq_s": lsq_s, "scorings": scorings, **trained})
        print(json.dumps(rows[-1]), flush=True)
    return {"model": name, "before": before, "keep": keep, "target": n_keep, "seq_len": seq_len,
            "score_tokens": int(scoring.attention_mask.sum()),
            "judge_tokens": int(judging.attention_mask.sum()), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON to write")
    parser.add_argument("model", help="a bundled model name")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--score-tokens", type=int, default=4096)
    parser.add_argument("--judge-tokens", type=int, default=8192)
    args = parser.parse_args()
    result = study(args.model, args.variants.split(","), seq_len=args.seq_len,
                   score_tokens=args.score_tokens, judge_tokens=args.judge_tokens)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
