"""Headline statistics of contribution weights streamed over a corpus (``docs/definitions.md`` §2.7, paper A).

:func:`contribution_overview` runs :class:`~mechgeom.analyses.contribution.ContributionCollector` batch by
batch and reduces each layer at once to the ``(sum, count)`` pairs of
:mod:`mechgeom.analyses.contribution.stats`; :meth:`ContributionResult.summary` gives the same numbers for a
result in memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from mechgeom.analyses.base import Result
from mechgeom.analyses.contribution.stats import SUMMARY_METRICS, ScoreTotals, overview_summary, view_layer_of
from mechgeom.analyses.contribution.weights import ContributionCollector, ContributionResult
from mechgeom.hooks import FwdHook, Queries, run_batches, to_batch, token_strings
from mechgeom.typing import Bool, Tensor

__all__ = [
    "ContributionOverview",
    "contribution_overview",
]


@dataclass
class ContributionOverview(Result):
    """Headline statistics of contribution weights over a corpus (:func:`contribution_overview`).

    ``heads``: one row per ``(layer, head)``, columns ``layer, head`` and the statistics of
    :func:`~mechgeom.analyses.contribution.stats.score_sums` (``sink_attention``,
    ``sink_value_weighted_normalized``, ``sink_contribution``, ``negative_share``, ``top1_agreement``,
    ``tv_attention_contribution``: means over texts and queries ``i >= 1``, positions inside each text,
    padding left out); ``layers``: the same
    statistics of the whole-layer (inter-head) metrics, one row per layer. ``view_layer`` is the layer of
    largest whole-layer TV (the first if all are NaN) and ``view`` its intra/inter ``attention`` and
    ``contribution`` for text 0.
    """

    heads: pd.DataFrame
    layers: pd.DataFrame
    view_layer: int
    view: ContributionResult
    n_texts: int

    def to_frame(self) -> pd.DataFrame:
        """The per-head table :attr:`heads`."""
        return self.heads

    def summary(self) -> dict[str, Any]:
        """``{"n_heads", "n_texts", "sink_attention", "sink_contribution", "sink_value_weighted_normalized",
        "negative_share", "top1_agreement", "view_layer", "view_layer_tv"}``: means over heads and the
        view layer with its whole-layer TV (the same keys as :meth:`ContributionResult.summary`)."""
        return overview_summary(self.heads, self.layers, self.n_texts)


def contribution_overview(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    *,
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    extra_hooks: Sequence[FwdHook] = (),
    verbose: bool = False,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
    queries: Queries = None,
) -> ContributionOverview:
    """Headline statistics of contribution weights over many texts, ``batch_size`` texts per pass.

    Streams :class:`ContributionCollector` (``on_layer``) with the metrics ``attention``,
    ``value_weighted_normalized`` and ``contribution``: each layer's metrics are reduced to ``(sum, count)``
    pairs (:class:`~mechgeom.analyses.contribution.stats.ScoreTotals`) as soon as they are computed, so
    memory stays at one layer of one batch (plus text 0 of each layer for the view). ``verbose`` shows a
    progress bar over the batches.

    Padding (``attention_mask``, by default the padding of a list of texts, left or right:
    :func:`~mechgeom.hooks.to_batch`) is never a query, a source or the sink: the statistics
    are those of the texts run one by one, pooled (see :func:`~mechgeom.analyses.contribution.stats.score_sums`).
    ``queries`` keeps some queries only (as :func:`contribution_weights` takes it), e.g. ``[-1]`` for each
    text's prediction position; only their rows are computed.

    >>> import torch
    >>> from transformer_lens.config import TransformerBridgeConfig
    >>> from transformer_lens.model_bridge import TransformerBridge
    >>> cfg = TransformerBridgeConfig(n_layers=2, d_model=8, n_ctx=8, d_head=4, n_heads=2,
    ...                               attn_only=True, d_vocab=10, seed=0)
    >>> model = TransformerBridge.boot_native(cfg)
    >>> ov = contribution_overview(model, torch.tensor([[1, 2, 3, 4], [4, 3, 2, 1]]), batch_size=1)
    >>> ov.summary()["n_heads"], ov.summary()["n_texts"], ov.view.layers == [ov.view_layer]
    (4, 2, True)
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 51 lines.
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    tokens, mask = to_batch(
        model, tokens_or_text, attention_mask=attention_mask, what="contribution_overview"
    )
    totals = ScoreTotals()
    first: dict[int, dict[str, Any]] = {}
    kept = ("attention", "contribution")

    def on_layer(layer: int, m: dict[str, Any]) -> None:
        intra, inter = m["intra"], m["inter"]  # [b h q k] and [b q k]
        key_mask, rows = m["key_mask"], m["query_index"]
        totals.add(layer, intra, inter, key_mask, rows)
        if layer not in first:  # text 0 (first batch) for the view
            # copies on the host (the streamed layer is on the model's device, in recycled buffers)
            first[layer] = {
                "intra": {k: intra[k][:1].to("cpu", copy=True) for k in kept},
                "inter": {k: inter[k][:1].to("cpu", copy=True) for k in kept},
                "key_mask": None if key_mask is None else key_mask[:1].to("cpu", copy=True),
                "query_index": None if rows is None else rows[:1].to("cpu", copy=True),
            }

    metrics = list(SUMMARY_METRICS)
    col = ContributionCollector(
        model, layers, intra=metrics, inter=metrics, on_layer=on_layer, queries=queries
    )
    stop = max(col.layers) + 1
    hooks = [*extra_hooks, *col.fwd_hooks]
    run_batches(
        model,
        tokens,
        hooks,
        batch_size=int(batch_size),
        stop_at_layer=stop,
        desc="contributions",
        verbose=verbose,
        attention_mask=mask,
    )
    heads, layer_frame = totals.heads_frame(), totals.layers_frame()
    view_layer = view_layer_of(layer_frame)
    view = ContributionResult(
        layers=[view_layer],
        tokens=tokens[:1].cpu(),
        intra={k: v[:, None] for k, v in first[view_layer]["intra"].items()},
        inter={k: v[:, None] for k, v in first[view_layer]["inter"].items()},
        str_tokens=token_strings(model, tokens[:1]),
        model_name=str(getattr(model.cfg, "model_name", "")),
        causal=col.causal,
        key_mask=first[view_layer]["key_mask"],
        query_index=first[view_layer]["query_index"],
    )
    return ContributionOverview(heads, layer_frame, view_layer, view, n_texts=int(tokens.shape[0]))
