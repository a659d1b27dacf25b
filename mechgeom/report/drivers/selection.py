"""The token-selection and head-taxonomy drivers (:mod:`mechgeom.analyses.selection`,
:mod:`mechgeom.analyses.heads.taxonomy`). The report's selection and taxonomy stages and ``mechgeom run
selection`` call these functions.

Selection tables: ``heads`` (:meth:`~mechgeom.analyses.selection.SelectionResult.to_frame`), ``params``
(the fitted regime per head), ``by_n``, ``sink_effect``, ``bounds``; figure ``f_vs_n``
(:func:`mechgeom.viz.plot_selection_vs_n`). Taxonomy tables: ``labels_<corpus>`` and ``regimes_<corpus>``
per corpus, ``regimes`` and ``distribution`` over every corpus, ``agreement`` (pairwise, with two corpora or
more); figure ``regimes`` (the first corpus).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from mechgeom.analyses.heads.taxonomy import (
    classify_heads,
    label_agreement,
    label_distribution,
    regime_summary,
)
from mechgeom.analyses.selection.collector import token_selection
from mechgeom.report.base import StageOutput
from mechgeom.typing import Tokens
from mechgeom.viz import plot_regime_grid, plot_selection_vs_n

__all__ = ["selection", "spread_layers", "taxonomy"]


def spread_layers(n_layers: int, k: int) -> list[int]:
    """``k`` layers spread evenly from the first to the last (fewer when the model has fewer).

    >>> spread_layers(30, 4), spread_layers(2, 4)
    ([0, 10, 19, 29], [0, 1])
    """
    return sorted({round(i * (n_layers - 1) / max(k - 1, 1)) for i in range(k)})


def selection(
    model: Any,
    tokens: Tokens,
    *,
    layers: Sequence[int] | None = None,
    ns: Sequence[int],
    n_random: int,
    query_stride: int,
    seed: int = 0,
    verbose: bool = False,
    title: str = "",
) -> StageOutput:
    """Token-selection geometry of every head of ``layers`` (default: all) on ``tokens``
    (:func:`~mechgeom.analyses.selection.token_selection`): its tables, the F-score figure, the summary
    lines and, as ``data``, the result's ``summary()``."""
    res = token_selection(
        model, tokens, layers=layers, ns=ns, n_random=n_random, query_stride=query_stride, seed=seed,
        verbose=verbose,
    )  # fmt: skip
    df, by_n = res.to_frame(), res.by_n_frame()
    s = res.summary()
    out = StageOutput(
        tables={
            "heads": df,
            "params": res.params_frame(),
            "by_n": by_n,
            "sink_effect": res.sink_effect_frame(),
            "bounds": res.bound_frame(),
        },
        figures={"f_vs_n": plot_selection_vs_n(by_n, df, title)},
        data=s,
    )
    out.summary = [
        f"{s['n_layers']} layers × {s['n_heads']} heads, N in {list(ns)}, every {query_stride}th query "
        f"of {int(tokens.shape[0])} window(s).",
        f"Top-N sets vs random N-subsets (N <= 4): mean F {s['f_top']:.3f} vs {s['f_random']:.3f} "
        f"(gap {s['f_gap']:+.3f}; paper B: top-N more separable at small N).",
        f"With the sink in I_N: F {s['f_top_sink_in']:.3f} with it vs {s['f_nosink_sink_in']:.3f} "
        "without position 0 (paper B: including it often halves F_N).",
        f"Inversion certificates violated {s['cert_violations']} times, the fitted sink-aware bound "
        f"{s['bound_violations']} times (both must be 0); the constant-norm regime holds for "
        f"{s['regime_share']:.1%} of heads.",
    ]
    return out


def _taxonomy_lines(summ: dict[str, Any]) -> list[str]:
    shares = summ["shares"]
    lines = [
        "Heads by regime: "
        + ", ".join(f"{lab} {shares.get(lab, 0.0):.1%}" for lab in ("Retriever", "Mixer", "Reset"))
        + " (paper B: Retrievers are 5.8–17.2% of heads; Mixer vs Reset depends on the model family).",
    ]
    if "cos_out_sink_mixer" in summ:
        lines.append(
            f"Alignment: Mixers' outputs vs the sink value cos {summ['cos_out_sink_mixer']:.3f}; "
            f"Retrievers' outputs vs the current token's value cos {summ['cos_out_cur_retriever']:.3f} "
            "(NaN where a regime has no head)."
        )
    return lines


def taxonomy(
    model: Any,
    corpora: Mapping[str, Any],
    *,
    sink_positions: int | Sequence[int] | None = None,
    batch_size: int = 8,
    verbose: bool = False,
    shown: str | None = None,
    title: str = "",
) -> StageOutput:
    """The Retriever/Mixer/Reset labels of every head on each corpus of ``corpora`` (token windows, or a
    ``TaxonomyResult`` already computed on them), the regimes per corpus and over all, the label
    distribution, and the agreement between corpora; the figure shows corpus ``shown`` (default: the
    first). ``data``: each corpus's ``summary()``, the regime
    shares and alignments per corpus, and the agreement's ``summary()``."""
    results = {
        c: classify_heads(
            model, x, sink_positions=sink_positions, batch_size=batch_size, corpus=c, verbose=verbose
        )
        if hasattr(x, "shape")
        else x
        for c, x in corpora.items()
    }
    tables = {c: r.to_frame() for c, r in results.items()}
    summaries = {c: r.summary() for c, r in results.items()}
    out = StageOutput()
    for c, table in tables.items():
        out.tables[f"labels_{c}"] = table
        out.tables[f"regimes_{c}"] = regime_summary(table)
    out.tables["distribution"] = label_distribution(
        pd.concat(tables.values(), ignore_index=True), by="corpus"
    )
    out.tables["regimes"] = pd.concat(
        [regime_summary(t).assign(corpus=c) for c, t in tables.items()], ignore_index=True
    )
    first = next(iter(tables))
    out.summary = _taxonomy_lines(summaries[first])
    agreement: dict[str, Any] = {}
    if len(tables) >= 2:
        agr = label_agreement(tables)
        out.tables["agreement"] = agr.pairwise
        agreement = agr.summary()
        out.summary.append(f"Label agreement {' vs '.join(tables)}: {agr.all_agree:.1%} of heads.")
    out.figures["regimes"] = plot_regime_grid(tables[shown or first], title=title)
    out.data = {
        "regime_shares": {c: s["shares"] for c, s in summaries.items()},
        "retriever_share": {c: s["shares"]["Retriever"] for c, s in summaries.items()},
        "alignment": [{"corpus": c, **row} for c, s in summaries.items() for row in s["alignment"]],
        "taxonomy": summaries,
        "agreement": agreement,
    }
    return out
