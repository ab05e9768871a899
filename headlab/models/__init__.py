"""headlab's model families (GPT-2, BERT, Llama and the decoders of `models.decoder`) and `load`."""

from headlab.attention.kv_cache import Cache
from headlab.models.base import HeadModel, ModelOutput
from headlab.models.loading import BUNDLED, ModelNotFoundError, load

__all__ = ["BUNDLED", "Cache", "HeadModel", "ModelNotFoundError", "ModelOutput", "load"]
