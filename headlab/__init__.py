"""headlab: see, score and prune the attention heads of transformer models."""

__version__ = "0.1.0"
