"""What a model is worth, measured: quality on held-out blocks (`quality`), the
lm-evaluation-harness tasks (`lm_eval`), needle-in-a-haystack retrieval (`needle`), and
the KV cache's bytes and decode speed (`cache`)."""
