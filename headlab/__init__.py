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
"""

__version__ = "0.1.0"

from headlab.analysis.patching import patch  # noqa: E402
from headlab.attention.hooks import Capture, capture, hooks  # noqa: E402
from headlab.data.blocks import Blocks, split_blocks  # noqa: E402
from headlab.data.texts import load_texts
from headlab.detectors import detect  # noqa: E402
from headlab.evaluate.quality import Quality, evaluate  # noqa: E402
from headlab.importance import HeadScores, score  # noqa: E402
from headlab.models import HeadModel, load  # noqa: E402
from headlab.objectives import make_blocks, prepare  # noqa: E402
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
    "load_texts",
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
