"""Attention sinks as active suppressors (``docs/definitions.md`` §4; paper A §3.2–3.3, paper B's sink geometry).

One layer, batch ``b``, head ``h``, query ``i``, source ``j <= i``; ``alpha = hook_pattern``,
``v = hook_v`` (GQA-expanded), ``vt[j,h] = v[j,h] @ W_O[h]``, ``o[i,h] = z[i,h] @ W_O[h]`` (no ``b_O``).
Projected values, norms and head outputs come from :class:`mechgeom.analyses.contribution.LayerGeometry`.

**Sink set.** ``sink_positions`` (default ``[0]``) is the sink set ``S``; every other position is a
non-sink. With more than one sink:

- the *sink rate* is the total mass on the set, ``sum_{s in S} alpha[h,i,s]`` (the mass of each sink
  position is kept beside it as ``sink_rate_pos``);
- the *sink value* statistics (norm ratio, cosine to the non-sink tokens) are per sink position;
- the per-query statistics (anti-alignment with ``m``, convexity) use the *sink vector*
  ``vt_S[i] = sum_{s in S} alpha[h,i,s] vt[s,h] / sum_{s in S} alpha[h,i,s]``, which is ``vt[0,h]``
  for the default single sink, and the non-sink mean
  ``m[i,h] = sum_{j ∉ S} alpha[h,i,j] vt[j,h] / sum_{j ∉ S} alpha[h,i,j]``. Its denominator equals
  ``1 - alpha[h,i,0]`` (rows sum to 1) but is summed explicitly, which stays accurate in float32
  where ``alpha[h,i,0]`` rounds to 1.

**Queries.** Query statistics use ``Q = {i : i > max(S)}``, the queries that see every sink and at
least one non-sink (``i >= 1`` for the default sink, as in ``docs/definitions.md`` §1.5). Per-query tensors are NaN for
queries outside ``Q``.

**Short sequences.** A sequence of length 1 (or any sequence with ``max(S) = pos - 1``) has no query
in ``Q`` and no non-sink token: every statistic is NaN and :meth:`SinkResult.to_frame` still returns
one row per (layer, head, sink) with NaN values. At length 2 with ``S = [0]`` the statistics rest on
one query and one non-sink token; variance shares need at least two entries and are NaN otherwise.
A sink position at or beyond the sequence length raises ``ValueError``.

**Basis.** Geometry is measured on the model as loaded (``b_O`` excluded). mechgeom's offline models are
loaded with ``center_writing_weights=True``, a no-op for their RMSNorm, so ``W_O`` is the checkpoint's.

The runs are here (:func:`sink_statistics`, :func:`sink_statistics_from_cache`, and on an encoder
:func:`~mechgeom.analyses.sinks.encoder.encoder_sink_statistics`); the formulas, :class:`SinkCollector` and
:class:`SinkResult` are :mod:`mechgeom.analyses.sinks.geometry`; the convexity maths and its intervention live in
:mod:`mechgeom.analyses.sinks.convexity`, the sink-value ablation in :mod:`mechgeom.analyses.sinks.ablation`.
All are re-exported here. The interventions are hook factories of :mod:`mechgeom.hooks`
(:func:`sink_mass_hooks` on ``hook_pattern``, :func:`sink_value_hooks` on ``hook_v``).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, Unpack

import numpy as np
import pandas as pd

from mechgeom._deprecation import warn_deprecated
from mechgeom.analyses.base import PassOptions, entry_point, run_collector
from mechgeom.analyses.sinks.encoder import encoder_sink_statistics
from mechgeom.analyses.sinks.geometry import SinkCollector, SinkResult
from mechgeom.hooks import Queries, TokensOrText, is_bidirectional

__all__ = [
    "sink_statistics",
    "sink_statistics_from_cache",
    "spread_sink_heads",
    "top_sink_heads",
]


@entry_point
def sink_statistics(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    sink_positions: int | str | Sequence[int | str] | None = None,
    batch_size: int = 8,
    queries: Queries = None,
    **run: Unpack[PassOptions],
) -> SinkResult:
    """Sink rate, norm ratios, anti-alignment, convexity terms and factor moments of every head of ``layers``.

    Args:
        model: a decoder, or an encoder (then ``sink_positions`` may name special tokens, ``["[CLS]", "[SEP]"]``,
            resolved in each text, and every query sees every sink: see
            :func:`~mechgeom.analyses.sinks.encoder.encoder_sink_statistics`).
        tokens_or_text: text, texts or token ids (the cached texts with ``cache``, optional there).
        layers: an int or a sequence of ints; ``None`` is every layer.
        sink_positions: the sink set, positions inside each text (default its first real token, wherever
            padding put it).
        batch_size: texts per forward pass; the pass stops after the last analysed layer (no unembedding).
        queries: the queries kept (:func:`mechgeom.hooks.select_queries`: positions inside each text, ``-1``
            its last token; a slice; a boolean mask); ``None`` keeps every real query. Only the kept queries
            are computed and enter the per-query tensors, the query means and the factor moments.

    Returns:
        A :class:`~mechgeom.analyses.sinks.geometry.SinkResult`.
    """
    if run["cache"] is None and tokens_or_text is not None and is_bidirectional(model):
        encoder = partial(encoder_sink_statistics, layers=layers, sink_positions=sink_positions)
        return encoder(
            model,
            tokens_or_text,
            batch_size=batch_size,
            extra_hooks=run["extra_hooks"],
            attention_mask=run["attention_mask"],
            verbose=run["verbose"],
            queries=queries,
        )
    col = SinkCollector(model, layers, sink_positions=sink_positions, queries=queries)  # type: ignore[arg-type]
    return run_collector(model, tokens_or_text, col, batch_size=batch_size, desc="sinks", **run)  # type: ignore[no-any-return]


def sink_statistics_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    tokens: TokensOrText | None = None,
    sink_positions: int | Sequence[int] | None = None,
) -> SinkResult:
    """Deprecated: ``sink_statistics(model, tokens, cache=cache, ...)`` gives the same result."""
    warn_deprecated("sink_statistics_from_cache(model, cache)", "sink_statistics(model, tokens, cache=cache)")
    return sink_statistics(model, tokens, layers=layers, cache=cache, sink_positions=sink_positions)


# =========================================================================== summaries and head choices


def _head_rows(stats: SinkResult, min_layer: int) -> pd.DataFrame:
    df = stats.to_frame().drop_duplicates(["layer", "head"])
    df = df[df["layer"] >= min_layer]
    if df.empty:
        raise ValueError(f"no head in a layer >= {min_layer}; analysed layers are {stats.layers}")
    return df


def top_sink_heads(stats: SinkResult, k: int, *, min_layer: int = 1) -> list[tuple[int, int]]:
    """The ``k`` heads with the largest sink rate among layers ``>= min_layer``, largest first."""
    top = _head_rows(stats, min_layer).nlargest(k, "sink_rate")
    return [(int(a), int(b)) for a, b in zip(top["layer"], top["head"], strict=True)]


def spread_sink_heads(stats: SinkResult, k: int = 3, *, min_layer: int = 1) -> list[tuple[int, int]]:
    """``k`` heads spread over the sink-rate order of layers ``>= min_layer``: the strongest sink head,
    evenly spaced ones, and the weakest (a strong, a median and a weak head for ``k = 3``)."""
    df = _head_rows(stats, min_layer).sort_values("sink_rate")
    idx = np.linspace(len(df) - 1, 0, k).round().astype(int)
    return [(int(df.iloc[i]["layer"]), int(df.iloc[i]["head"])) for i in idx]
