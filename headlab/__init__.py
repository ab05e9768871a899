"""headlab: see, score and prune the attention heads of transformer models.

    model = headlab.load("smollm2-135m")
    with headlab.capture(model, "pattern") as cap:
        model(ids)
    scores = headlab.score(model, blocks, method="michel")
    plan = headlab.select(scores, keep=0.6)
    headlab.prune(model, plan)
    headlab.evaluate(model, heldout)
"""

__version__ = "0.1.0"

from headlab.data import Blocks, load_texts, make_blocks, split_blocks  # noqa: E402
from headlab.evaluate import Quality, evaluate, prepare  # noqa: E402
from headlab.hooks import Capture, capture, hooks  # noqa: E402
from headlab.importance import HeadScores, score  # noqa: E402
from headlab.models import HeadModel, load  # noqa: E402
from headlab.pruning import PrunePlan, prune, prune_to_target, select  # noqa: E402

__all__ = [
    "Blocks",
    "Capture",
    "HeadModel",
    "HeadScores",
    "PrunePlan",
    "Quality",
    "__version__",
    "capture",
    "evaluate",
    "hooks",
    "load",
    "load_texts",
    "make_blocks",
    "prepare",
    "prune",
    "prune_to_target",
    "score",
    "select",
    "split_blocks",
]
