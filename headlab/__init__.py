"""headlab: see, score and prune the attention heads of transformer models.

    model = headlab.load("smollm2-135m")
    with headlab.capture(model, "pattern") as cap:
        model(ids)
    scores = headlab.score(model, blocks, method="michel")
    total = model.n_layers * model.n_original_heads
    plan = headlab.select(scores, headlab.heads_to_keep(total, keep=0.6))
    reference = headlab.pruning.copy_model(model)
    headlab.prune(model, plan)
    headlab.recover(model, reference, blocks, method="lsq")
    headlab.evaluate(model, heldout)

Interpretability (docs/python-api.md, "Interpretability in ten lines"):

    cap.stack("pattern")                                  # (layers, B, H, S, T)
    headlab.detect(model, "induction").top(5)             # induction heads
    with headlab.hooks(model, headlab.hooks.ablate_heads(model, {18: [6]})):
        headlab.loss(model, ids)                          # the loss with L18H6 ablated
    headlab.logit_attribution(model, text, target=" Mary", foil=" John").top(5)
    headlab.patch(model, [clean], [corrupted], metric=headlab.logit_diff(" Mary", " John"))
"""

__version__ = "0.1.0"

# evaluate and hooks are modules that call as their functions (headlab._util.modules)
from headlab import evaluate  # noqa: E402
from headlab.analysis.attribution import logit_attribution  # noqa: E402
from headlab.analysis.patching import logit_diff, patch  # noqa: E402
from headlab.attention import hooks  # noqa: E402
from headlab.attention.hooks import Capture, capture  # noqa: E402
from headlab.data.blocks import Blocks, split_blocks  # noqa: E402
from headlab.data.texts import load_texts
from headlab.detectors import detect  # noqa: E402
from headlab.evaluate.quality import Quality  # noqa: E402
from headlab.importance import HeadScores, score  # noqa: E402
from headlab.models import HeadModel, load  # noqa: E402
from headlab.objectives import loss, make_blocks, prepare  # noqa: E402
from headlab.pruning import prune  # noqa: E402
from headlab.recovery import RecoveryReport, recover  # noqa: E402
from headlab.results import RunResult  # noqa: E402
from headlab.schedule import prune_to_target  # noqa: E402
from headlab.selection import PrunePlan, heads_to_keep, select  # noqa: E402

__all__ = [
    "Blocks",
    "Capture",
    "HeadModel",
    "HeadScores",
    "PrunePlan",
    "RecoveryReport",
    "RunResult",
    "Quality",
    "__version__",
    "capture",
    "detect",
    "evaluate",
    "heads_to_keep",
    "hooks",
    "load",
    "loss",
    "load_texts",
    "logit_attribution",
    "logit_diff",
    "make_blocks",
    "patch",
    "prepare",
    "prune",
    "prune_to_target",
    "recover",
    "score",
    "select",
    "split_blocks",
]
