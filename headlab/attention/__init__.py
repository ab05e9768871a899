"""Attention: `MultiHeadAttention` (the one attention maths every model is built on), its
masks (`masks`), key/value caches (`kv_cache`), rotary embeddings (`rotary`), the sink +
window cache of demoted heads (`streaming`), the hook points on its intermediates
(`hookpoint`) and the capture API over them (`hooks`).

Notation used for tensor shapes:
    B   batch size
    S   query length (new positions in this call)
    T   key length (past positions from the cache + S)
    H   query heads
    H_kv key/value heads (H for MHA, 1 for MQA, a divisor of H for GQA)
    D   head dimension
    E   model dimension

One module covers the three layouts; only the number of key/value heads differs::

     MHA (H_kv = H)        GQA (H_kv = H/2)       MQA (H_kv = 1)
    q: 1 2 3 4            q: 1 2 3 4             q: 1 2 3 4
       | | | |               \\/   \\/                \\ \\/ /
    k: 1 2 3 4            k:  1    2             k:    1

After physical pruning a group may lose some of its query heads, so each query head
carries the index of its key/value head (``kv_index``) instead of relying on
equal-sized groups.
"""

from headlab.attention.multihead import MultiHeadAttention

__all__ = ["MultiHeadAttention"]
