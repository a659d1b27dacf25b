"""The one place where mechgeom's jaxtyping aliases live.

Dimension names follow TransformerLens (``batch pos head_index d_head``,
``batch head_index query_pos key_pos``) so that shapes read the same as in
``HookedTransformer``'s own annotations.

>>> import torch
>>> from mechgeom.typing import Pattern
>>> isinstance(torch.zeros(1, 2, 3, 3), Pattern)
True
"""

from __future__ import annotations

import torch
from jaxtyping import Bool, Float, Int, Integer
from torch import Tensor

__all__ = [
    "WO",
    "Bool",
    "Float",
    "HeadOut",
    "HeadQueries",
    "HeadScores",
    "Int",
    "Integer",
    "LayerScores",
    "Pattern",
    "PatternMask",
    "QueryKey",
    "QueryKeyMask",
    "SourceRanks",
    "Tensor",
    "Tokens",
    "Values",
    "Z",
]

#: ``blocks.{l}.attn.hook_pattern``: softmax attention weights.
Pattern = Float[Tensor, "batch head_index query_pos key_pos"]
#: A boolean mask of the same shape as the pattern (``True`` = remove the source).
PatternMask = Bool[Tensor, "batch head_index query_pos key_pos"]
#: ``blocks.{l}.attn.hook_v`` after GQA expansion.
Values = Float[Tensor, "batch pos head_index d_head"]
#: ``blocks.{l}.attn.hook_z``.
Z = Float[Tensor, "batch pos head_index d_head"]
#: Per-head outputs ``z @ W_O`` (bias excluded).
HeadOut = Float[Tensor, "batch pos head_index d_model"]
#: ``model.W_O[l]``.
WO = Float[Tensor, "head_index d_head d_model"]
#: A per-head score over (query, key) pairs.
HeadScores = Float[Tensor, "batch head_index query_pos key_pos"]
#: A whole-layer score over (query, key) pairs.
LayerScores = Float[Tensor, "batch query_pos key_pos"]
#: A per-head quantity of each query (``[batch, head_index, query_pos]``), e.g. an F-score or a bound.
HeadQueries = Float[Tensor, "batch head_index query_pos"]
#: Which (query, key) pairs a per-query set holds: the candidate sources of each query, ``True`` = in the set.
QueryKeyMask = Bool[Tensor, "*batch query_pos key_pos"]
#: Any ``[query_pos, key_pos]`` matrix.
QueryKey = Float[Tensor, "query_pos key_pos"]
#: Per-query rank of each source (0 = top-ranked), ``rank_head`` is ``head_index`` or 1 (whole layer);
#: a small integer dtype (uint8 up to 256 positions, else int16/int32).
SourceRanks = Integer[Tensor, "batch rank_head query_pos key_pos"]
#: Token ids.
Tokens = Int[Tensor, "batch pos"]

DType = torch.dtype
