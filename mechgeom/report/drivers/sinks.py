"""The sinks drivers (:mod:`mechgeom.analyses.sinks`): a decoder's sink statistics, the convexity check by
intervention and the sink-value ablation; an encoder's ``[CLS]``/``[SEP]`` statistics over several corpora.
The report's sinks stages, ``mechgeom run sinks`` and ``mechgeom run encoder`` call these functions.

**Convexity heads.** The check runs on :func:`~mechgeom.analyses.sinks.statistics.spread_sink_heads`: the
strongest sink head, evenly spaced ones and the weakest (of layers >= 1). The closed form ``‖o(s)‖`` is a
claim about every head, so the check samples the whole range of sink rates rather than only the strongest
sinks, where ``s`` sits near 1 and a wrong curve could still agree at the one point that matters.

Tables: ``heads`` (:meth:`~mechgeom.analyses.sinks.SinkResult.to_frame`), ``convexity`` (every measured
point) and ``convexity_max_error`` (per head and ``s``), ``ablation_<mode>`` (per head) and
``ablation_summary`` (one row per ablation). Figures: ``rate_vs_ratio``, ``s_star``, ``convexity``,
``cone_shift``. The encoder's: ``heads`` (every corpus, with a ``corpus`` column), ``heads_<corpus>``,
``by_corpus`` (means over heads per corpus and sink) and the figure ``rate_vs_ratio`` of the first corpus.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from mechgeom._progress import progress
from mechgeom.analyses.sinks import convexity_check, sink_ablation
from mechgeom.analyses.sinks.ablation import AblationMode
from mechgeom.analyses.sinks.statistics import sink_statistics, spread_sink_heads
from mechgeom.report.base import StageOutput
from mechgeom.typing import Tokens
from mechgeom.viz import plot_cone_shift, plot_convexity_curves, plot_rate_vs_ratio, plot_sink_rate_vs_s_star

__all__ = ["S_VALUES", "encoder_sinks", "sinks"]

#: The sink-mass grid of the convexity check.
S_VALUES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
#: The means over heads that summarise an encoder's sinks per corpus.
_ENCODER_COLUMNS = ["sink_rate_pos", "norm_ratio_vt", "cos_sink_tokens", "cos_sink_mean"]


def _convexity(
    model: Any,
    tokens: Tokens,
    stats: Any,
    *,
    n_heads: int,
    s_values: Sequence[float],
    n_texts: int | None,
    verbose: bool,
) -> StageOutput:
    """The convexity check on ``n_heads`` spread heads and the first ``n_texts`` texts (default: all; the
    statistics of fewer texts are those texts' own, on the chosen heads' layers)."""
    chosen = spread_sink_heads(stats, n_heads)
    sub, sub_stats = tokens, stats
    if n_texts is not None and n_texts < tokens.shape[0]:
        sub = tokens[:n_texts]
        layers = sorted({layer for layer, _ in chosen})
        sub_stats = sink_statistics(model, sub, layers=layers, sink_positions=stats.sink_positions)
    check = convexity_check(model, sub, heads=chosen, s_values=s_values, stats=sub_stats, verbose=verbose)
    summary = check.summary()
    return StageOutput(
        tables={"convexity": check.to_frame(), "convexity_max_error": check.max_error_frame()},
        figures={"convexity": plot_convexity_curves(sub_stats, chosen, measured=check.measured)},
        data={
            "convexity_check_heads": summary["heads"],
            "convexity_check_max_abs_err": summary["max_abs_error"],
            "convexity_check_max_rel_err": summary["max_rel_error"],
            "convexity_check_points": summary["n_points"],
        },
    )


def _ablations(
    model: Any,
    tokens: Tokens,
    *,
    modes: Sequence[AblationMode],
    per_layer_texts: int,
    sink_positions: Any,
    n_boot: int,
    seed: int,
    batch_size: int,
    verbose: bool,
) -> StageOutput:
    """The sink-value ablation of every layer and head in each mode (the clean pass shared), then, on the
    first ``per_layer_texts`` texts, of each layer alone (zero mode): one summary row per ablation."""
    out = StageOutput()
    rows, clean = [], None
    for mode in modes:
        res = sink_ablation(
            model, tokens, mode=mode, sink_positions=sink_positions, seed=seed, batch_size=batch_size,
            clean=clean, verbose=verbose,
        )  # fmt: skip
        clean = res
        out.tables[f"ablation_{mode}"] = res.to_frame()
        rows.append({"scope": "all layers", **res.summary(n_boot=n_boot, seed=seed)})
        out.figures.setdefault("cone_shift", plot_cone_shift(res))
    if per_layer_texts > 0:
        few, clean_few = tokens[:per_layer_texts], None
        for layer in progress(range(int(model.cfg.n_layers)), desc="per-layer ablation", enabled=verbose):
            res = sink_ablation(
                model, few, layers=layer, mode="zero", sink_positions=sink_positions, seed=seed,
                batch_size=batch_size, clean=clean_few,
            )  # fmt: skip
            clean_few = res
            rows.append({"scope": f"layer {layer}", **res.summary(n_boot=n_boot, seed=seed)})
    out.tables["ablation_summary"] = pd.DataFrame(rows)
    out.data["ablation"] = out.tables["ablation_summary"].to_dict(orient="records")
    return out


def _lines(st: dict[str, Any], conv: dict[str, Any], abl: dict[str, Any], mode: str) -> list[str]:
    return [
        f"Mean sink rate {st['mean_sink_rate']:.3f} over {st['n_heads']} heads; sink norm ratio "
        f"(projected) median {st['norm_ratio_vt_median']:.3f} (paper B: 3–10× smaller, i.e. 0.1–0.33); "
        f"{st['share_norm_ratio_vt_below_third']:.1%} of heads below 1/3.",
        f"Anti-alignment: mean cos(vt_sink, m) = {st['mean_cos_sink_mean']:.3f}; "
        f"s* lies inside (0, 1) for {st['interior_share_pooled']:.1%} of (head, query) pairs.",
        f"Convexity by intervention on {', '.join(f'L{a}H{b}' for a, b in conv['convexity_check_heads'])} "
        f"(strong to weak sinks) matches the closed form: max relative error "
        f"{conv['convexity_check_max_rel_err']:.2e} over {conv['convexity_check_points']} points.",
        f"Sink-value ablation ({mode}, every layer and head): ΔPPL {abl['dppl_sink']:+.3f} "
        f"(ΔNLL 95% CI [{abl['dnll_sink_lo']:+.3f}, {abl['dnll_sink_hi']:+.3f}]) vs random-position control "
        f"ΔPPL {abl['dppl_control']:+.3f}; mean relative change of the head-output norm "
        f"{abl['d_out_norm_rel_sink']:+.1%} (control {abl['d_out_norm_rel_control']:+.1%}), "
        f"Δcos(o, mu) {abl['d_cone_cos_sink']:+.3f} (control {abl['d_cone_cos_control']:+.3f}).",
    ]


def sinks(
    model: Any,
    tokens: Tokens,
    *,
    stats: Any = None,
    sink_positions: int | Sequence[int] | None = None,
    convexity_heads: int = 3,
    s_values: Sequence[float] = S_VALUES,
    convexity_texts: int | None = None,
    ablation_modes: Sequence[AblationMode] = ("zero",),
    per_layer_texts: int = 0,
    n_boot: int = 1000,
    seed: int = 0,
    batch_size: int = 8,
    verbose: bool = False,
) -> StageOutput:
    """A decoder's sinks on ``tokens``: statistics (``stats``, a :class:`SinkResult` of the same texts,
    when already computed), the convexity check on ``convexity_heads`` spread heads and the first
    ``convexity_texts`` texts, and the sink-value ablation in each of ``ablation_modes`` (plus per layer on
    ``per_layer_texts`` texts). ``data``: the statistics' ``summary()``, the check's heads and errors and
    the ablation rows."""
    if stats is None:
        stats = sink_statistics(
            model, tokens, sink_positions=sink_positions, batch_size=batch_size, verbose=verbose
        )
    st = stats.summary()
    out = StageOutput(
        tables={"heads": stats.to_frame()},
        figures={
            "rate_vs_ratio": plot_rate_vs_ratio(stats, space="vt"),
            "s_star": plot_sink_rate_vs_s_star(stats),
        },
        data={"sink_positions": stats.sink_positions, "basis": stats.basis, **st},
    )
    conv = _convexity(
        model, tokens, stats, n_heads=convexity_heads, s_values=s_values, n_texts=convexity_texts,
        verbose=verbose,
    )  # fmt: skip
    abl = _ablations(
        model, tokens, modes=ablation_modes, per_layer_texts=per_layer_texts, sink_positions=sink_positions,
        n_boot=n_boot, seed=seed, batch_size=batch_size, verbose=verbose,
    )  # fmt: skip
    for part in (conv, abl):
        out.tables.update(part.tables)
        out.figures.update(part.figures)
        out.data.update(part.data)
    out.summary = _lines(st, conv.data, abl.data["ablation"][0], ablation_modes[0])
    return out


def encoder_sinks(
    model: Any,
    corpora: Mapping[str, Tokens],
    *,
    sink_positions: Sequence[int | str] = ("[CLS]", "[SEP]"),
    batch_size: int = 8,
    verbose: bool = False,
) -> StageOutput:
    """An encoder's sinks (named special tokens, resolved in each window) on each corpus: the statistics per
    (corpus, layer, head, sink), their means over heads per (corpus, sink), and per corpus the
    statistics' ``summary()`` (``data["sinks"]``)."""
    out = StageOutput(data={"sinks": {}})
    frames, rows = [], []
    for corpus, tokens in corpora.items():
        stats = sink_statistics(
            model, tokens, sink_positions=list(sink_positions), batch_size=batch_size, verbose=verbose
        )
        frame = stats.to_frame()
        out.tables[f"heads_{corpus}"] = frame
        frames.append(frame.assign(corpus=corpus)[["corpus", *frame.columns]])
        for sink, d in frame.groupby("sink", sort=False):
            rows.append(
                {
                    "corpus": corpus,
                    "sink": sink,
                    "n_texts": int(tokens.shape[0]),
                    **d[_ENCODER_COLUMNS].mean(),
                }
            )
        out.data["sinks"][corpus] = stats.summary()
        out.figures.setdefault("rate_vs_ratio", plot_rate_vs_ratio(stats))
    out.tables["heads"] = pd.concat(frames, ignore_index=True)
    out.tables["by_corpus"] = pd.DataFrame(rows)
    out.data["sinks_by_corpus"] = out.tables["by_corpus"].to_dict(orient="records")
    first = next(iter(corpora))
    by = out.tables["by_corpus"][out.tables["by_corpus"]["corpus"] == first]
    out.summary = [
        f"{row['sink']}: attention mass {row['sink_rate_pos']:.3f} (mean over heads and every query), value norm "
        f"{row['norm_ratio_vt']:.3f}× the mean of the other tokens (projected), mean cosine to the other "
        f"tokens' values {row['cos_sink_tokens']:+.3f}."
        for _, row in by.iterrows()
    ]
    out.summary.append(
        f"Anti-alignment of the sink vector with the non-sink mean: mean cos "
        f"{out.data['sinks'][first]['mean_cos_sink_mean']:+.3f}. Kobayashi et al. (2020) on BERT: [CLS] and "
        "[SEP] draw much attention but carry small value norms."
    )
    return out
