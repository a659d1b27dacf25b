"""Sinks on an encoder (``docs/definitions.md`` §4.7, for a bidirectional model; Kobayashi et al. 2020 on BERT).

An encoder has no position-0 sink by construction: its candidate sinks are special tokens, ``[CLS]`` at the
start and ``[SEP]`` at the end of each text, whose position depends on the text's length. Here
``sink_positions`` may name them (``["[CLS]", "[SEP]"]``, or mix names and positions); each name is resolved
in each text to the one position where that token stands (:func:`mechgeom.hooks.sink_positions_per_text`).

The statistics are those of :mod:`mechgeom.analyses.sinks.statistics`, with two encoder rules:

- **Queries.** Every query sees every key, so ``Q`` is every position (the sinks' own queries included),
  and the non-sink tokens are every ``j ∉ S`` (no ``j <= i``).
- **Padding.** Texts are analysed without padding (left or right padding is removed first): they are
  grouped by length and sink set (equal within a group), each group in batches of ``batch_size`` texts. The
  per-query tensors of the merged :class:`~mechgeom.analyses.sinks.SinkResult` are NaN beyond each text's
  length (as outside ``Q``), positions are inside each text, its texts are in the order given, and
  ``sink_positions`` holds the names (or positions) as given, in the order of their positions;
  ``extras["sink_positions_per_text"]`` holds the resolved positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mechgeom.analyses.base import collect
from mechgeom.analyses.sinks.geometry import SinkCollector, SinkResult
from mechgeom.hooks import (
    FwdHook,
    Queries,
    TokensOrText,
    select_queries,
    sink_positions_per_text,
    text_spans,
    to_batch,
)
from mechgeom.typing import Tensor

__all__ = [
    "encoder_sink_statistics",
    "merge_sink_results",
]

#: Per-query fields of a SinkResult (``[n, layer, head, q]``), padded with NaN (``modified``: False).
_PER_QUERY = ("sink_mass", "sq_sink", "cross", "sq_mean")
#: Per-text fields without a query axis (``[n, layer, head]`` or ``[n, layer, head, sink]``).
_PER_TEXT = (
    "sink_rate",
    "sink_rate_pos",
    "norm_ratio_v",
    "norm_ratio_vt",
    "cos_sink_tokens",
    "cos_sink_mean",
)


def encoder_sink_statistics(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    layers: int | Sequence[int] | None = None,
    sink_positions: int | str | Sequence[int | str] | None = None,
    batch_size: int = 8,
    extra_hooks: Sequence[FwdHook] = (),
    attention_mask: Tensor | None = None,
    verbose: bool = False,
    queries: Queries = None,
) -> SinkResult:
    """:func:`~mechgeom.analyses.sinks.sink_statistics` on an encoder: sink sets resolved per text (names
    such as ``"[CLS]"``, ``"[SEP]"``), texts grouped by length and sink set, no padding in any pass.

    ``attention_mask`` (``[batch, pos]``, 1 = real) marks padding in ``tokens``, on the left or the right of
    each text; by default the tokenizer's ``[PAD]`` (:func:`mechgeom.hooks.padding_mask`). ``queries`` keeps
    some queries (:func:`mechgeom.hooks.select_queries`, positions inside each text).
    """
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    tokens, mask = to_batch(model, tokens_or_text, attention_mask=attention_mask, encoders=True)
    n_texts, width = int(tokens.shape[0]), int(tokens.shape[1])
    starts, lens = text_spans(mask, n_texts, width)
    lengths = [int(n) for n in lens.tolist()]
    texts = [tokens[b, int(starts[b]) : int(starts[b]) + n] for b, n in enumerate(lengths)]
    keep = select_queries(queries, mask, n_texts, width)
    kept = [keep[b, int(starts[b]) : int(starts[b]) + n] for b, n in enumerate(lengths)]
    aligned = torch.stack(
        [torch.nn.functional.pad(t, (0, width - len(t)), value=_pad_id(model)) for t in texts]
    )
    per_text = sink_positions_per_text(model, aligned, sink_positions, lengths)
    labels = _sink_labels(sink_positions, texts, per_text, model)
    groups: dict[tuple[int, tuple[int, ...]], list[int]] = {}
    for b, (n, pos) in enumerate(zip(lengths, per_text, strict=True)):
        groups.setdefault((n, tuple(pos)), []).append(b)
    parts = []
    for (_, group_pos), idx in groups.items():
        group_keep = torch.stack([kept[b] for b in idx])
        col = SinkCollector(model, layers, sink_positions=list(group_pos), queries=group_keep)
        group_tokens = torch.stack([texts[b] for b in idx])
        res = collect(
            model,
            group_tokens,
            col,
            batch_size=batch_size,
            extra_hooks=extra_hooks,
            desc="sinks",
            verbose=verbose,
        )
        parts.append((idx, res))
    merged = merge_sink_results(parts, n_texts=len(texts), pad_id=_pad_id(model))
    merged.sink_positions = labels
    merged.extras["sink_positions_per_text"] = per_text
    merged.extras["lengths"] = lengths
    return merged


def _pad_id(model: Any) -> int:
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    return 0 if pad is None else int(pad)


def _sink_labels(given: Any, texts: list[Tensor], per_text: list[list[int]], model: Any) -> list[Any]:
    """Each sink's label (its name, or its position) in the order of the resolved positions, the same in
    every text; ``ValueError`` if the names stand in a different order in some text."""
    items = [given] if isinstance(given, int | str) else list(given if given is not None else [0])
    if not any(isinstance(s, str) for s in items):
        return sorted(int(s) for s in items)
    orders = set()
    for t, pos in zip(texts, per_text, strict=True):
        label_at = {}
        for s in items:
            p = int(s) if not isinstance(s, str) else sink_positions_per_text(model, t[None], [s])[0][0]
            label_at[p] = s
        orders.add(tuple(label_at[p] for p in pos))
    if len(orders) > 1:
        raise ValueError(
            f"the sinks {items} stand in different orders in different texts: {sorted(orders, key=str)}"
        )
    return list(orders.pop())


def merge_sink_results(
    parts: Sequence[tuple[Sequence[int], SinkResult]], *, n_texts: int, pad_id: int = 0
) -> SinkResult:
    """One :class:`SinkResult` from results on disjoint sets of texts (``parts``: the texts' indices and
    their result): per-text tensors in text order, per-query tensors NaN-padded to the longest text,
    factor moments summed, tokens right-padded with ``pad_id``."""
    if not parts:
        raise ValueError("no results to merge")
    first = parts[0][1]
    n_sinks = {int(r.sink_rate_pos.shape[-1]) for _, r in parts}
    if len(n_sinks) > 1 or any(r.layers != first.layers for _, r in parts):
        raise ValueError("results to merge must have the same layers and the same number of sinks")
    order = torch.tensor([b for idx, _ in parts for b in idx])
    if sorted(order.tolist()) != list(range(n_texts)):
        raise ValueError(f"the parts' text indices must cover 0..{n_texts - 1} once each")
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order))
    q = max(int(r.sink_mass.shape[-1]) for _, r in parts)

    def pad(t: Tensor, fill: Any) -> Tensor:
        return torch.nn.functional.pad(t, (0, q - t.shape[-1]), value=fill)

    fields: dict[str, Any] = {}
    for name in _PER_TEXT:
        fields[name] = torch.cat([getattr(r, name) for _, r in parts])[inverse]
    for name in _PER_QUERY:
        fields[name] = torch.cat([pad(getattr(r, name), float("nan")) for _, r in parts])[inverse]
    mods = [
        r.modified if r.modified is not None else torch.zeros_like(r.sink_mass, dtype=torch.bool)
        for _, r in parts
    ]
    fields["modified"] = torch.cat([pad(m, False) for m in mods])[inverse]
    tokens = None
    str_tokens = None
    if all(r.tokens is not None for _, r in parts):
        tokens = torch.cat([pad(r.tokens, pad_id) for _, r in parts])[inverse]  # type: ignore[arg-type]
        if all(r.str_tokens is not None for _, r in parts):
            flat = [s for _, r in parts for s in r.str_tokens]  # type: ignore[union-attr]
            str_tokens = [flat[i] for i in inverse.tolist()]
    return SinkResult(
        layers=list(first.layers),
        sink_positions=list(first.sink_positions),
        n_kv_heads=first.n_kv_heads,
        factor_sums=sum((r.factor_sums for _, r in parts), torch.zeros_like(first.factor_sums)),
        model_name=first.model_name,
        basis=first.basis,
        tokens=tokens,
        str_tokens=str_tokens,
        **fields,
    )
