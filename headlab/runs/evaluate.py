"""An eval run: a model's (or a pruned run directory's) held-out quality, and the lm-eval
tasks and needle test its configuration asks for, through the same inputs and task
stages as a prune or score run; nothing is written."""

from __future__ import annotations

from typing import Any

from headlab.errors import UserError
from headlab.evaluate.quality import evaluate
from headlab.objectives import objective_for
from headlab.runs.config import RunConfig
from headlab.runs.inputs import build_data, load_model
from headlab.runs.placement import Placement
from headlab.runs.preflight import check_data, check_model_config
from headlab.runs.stages import needle_grid, task_metrics


def evaluate_run(cfg: RunConfig, *, reference: str | None = None) -> dict[str, Any] | None:
    """The summary of an eval run (quality, heads, parameters, and "tasks" with
    "lm_eval", the version, and "needle" where ``cfg.tasks`` asks for them); None on the
    ranks other than rank 0, which alone reports.

    ``reference``: the unpruned model an embedding model's fidelity is measured against
    (its objective needs one); the held-out data are prepared on it.
    """
    check_data(cfg)  # before the model loads, as its config and the tasks and their code
    check_model_config(cfg)
    if any(t != "needle" for t in cfg.tasks):
        from headlab.evaluate.lm_eval import check_tasks

        check_tasks([t for t in cfg.tasks if t != "needle"], cfg.include_path,
                    trust_code=cfg.trust_task_code)
    model = load_model(cfg)
    ref = model
    if objective_for(model).needs_reference:
        if reference is None:
            raise UserError("embedding fidelity compares with the unpruned model: "
                            "pass --reference ORIGINAL_MODEL")
        ref = load_model(RunConfig.from_dict({**cfg.to_dict(), "model": reference}))
    _, heldout, _ = build_data(cfg, ref)
    q = evaluate(model, heldout, batch_size=cfg.batch_size)
    if not Placement.here(model).writes:
        return None
    summary: dict[str, Any] = {"model": cfg.model, **q.to_json(),
                               "heads": model.heads_per_layer,
                               "params": model.num_parameters()}
    if any(t != "needle" for t in cfg.tasks):
        from headlab.evaluate.lm_eval import lm_eval_version

        summary["tasks"] = task_metrics(cfg, model)
        summary["lm_eval"] = lm_eval_version()
    if "needle" in cfg.tasks:
        summary["needle"] = needle_grid(cfg, model).to_json()
    return summary
