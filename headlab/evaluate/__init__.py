"""What a model is worth, measured: quality on held-out blocks (`quality`), the
lm-evaluation-harness tasks (`lm_eval`), needle-in-a-haystack retrieval (`needle`), and
the KV cache's bytes and decode speed (`cache`).

The package is also the function: ``headlab.evaluate(model, blocks)`` calls
`headlab.evaluate.quality.evaluate`, while ``headlab.evaluate.needle`` stays the module.
"""

from headlab._util.modules import make_callable


def _evaluate():
    from headlab.evaluate.quality import evaluate

    return evaluate


make_callable(__name__, _evaluate)
