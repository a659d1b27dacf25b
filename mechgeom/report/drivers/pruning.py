"""The head-pruning drivers (:mod:`mechgeom.analyses.heads`): the single-head ablation sweep (critical-head
leaderboard) and the retention curves of each head order. The report's pruning stage, ``mechgeom run
pruning`` and ``mechgeom sweep pruning`` call these functions.

Tables: ``single_head`` (the leaderboard, most harmful first), ``heads`` (per-head statistics, the sweep's
ΔPPL and the taxonomy label), ``retention`` (tidy curves), ``comparison`` and ``retention_summary``.
Figure: ``retention``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mechgeom.analyses.heads import head_orders, head_stats, head_table
from mechgeom.analyses.heads.pruning import (
    RETENTION_LEVELS,
    retention_curves,
    single_head_sweep,
    sweep_exactness,
)
from mechgeom.hooks import HeadAblationMode
from mechgeom.report.base import StageOutput
from mechgeom.sweep import Executor
from mechgeom.typing import Tokens
from mechgeom.viz import plot_retention

__all__ = ["pruning", "single_head"]


def single_head(
    model: Any,
    tokens: Tokens,
    *,
    mode: HeadAblationMode = "zero",
    means: Any = None,
    heads: Sequence[tuple[int, int]] | None = None,
    k: float = 5.0,
    verify_heads: int = 0,
    batch_size: int = 8,
    checkpoint: str | Path | None = None,
    executor: Executor | None = None,
    verbose: bool = False,
) -> tuple[Any, StageOutput]:
    """The single-head sweep (:func:`~mechgeom.analyses.heads.pruning.single_head_sweep`) and its output:
    the leaderboard (critical heads: ΔPPL above median + ``k``·MAD), its summary line and ``data`` (the
    leaderboard's ``summary()``, and with ``verify_heads`` the full-forward check of that many heads)."""
    sweep = single_head_sweep(
        model, tokens, heads=heads, mode=mode, means=means, batch_size=batch_size, checkpoint=checkpoint,
        executor=executor, verbose=verbose,
    )  # fmt: skip
    board = sweep.summary(k=k)
    data: dict[str, Any] = {"clean_ppl_ref": sweep.clean_ppl, "leaderboard": board}
    if verify_heads > 0:
        check = sweep_exactness(model, tokens, sweep, verify_heads, means=means, batch_size=batch_size)
        data["start_at_layer_check"] = check
    crit = board["critical"]
    (wl, wh), worst = board["worst_head"], board["worst_delta_ppl"]
    line = (
        f"Single-head ablation: median ΔPPL {board['median_delta_ppl']:+.3f}; the most harmful head is "
        f"L{wl}H{wh} (ΔPPL {worst:+.3f}); {len(crit)} critical head(s) (ΔPPL > median + {k:g}·MAD)"
        + (": " + ", ".join(f"L{a}H{b}" for a, b in crit) if crit else "")
        + "."
    )
    return sweep, StageOutput(tables={"single_head": sweep.to_frame(k=k)}, summary=[line], data=data)


def _retention(
    model: Any,
    stats: Any,
    sweep: Any,
    corpora: Mapping[str, Tokens],
    *,
    orders: Sequence[str] | None,
    seed: int,
    title: str,
    **curve_options: Any,
) -> StageOutput:
    """Retention curves of every head order (or those named in ``orders``) on ``corpora``
    (:func:`~mechgeom.analyses.heads.pruning.retention_curves` with ``curve_options``)."""
    wanted = head_orders(model, stats, sweep=sweep, seed=seed)
    if orders is not None:
        wanted = {k: v for k, v in wanted.items() if k in orders}
    curves = retention_curves(model, wanted, corpora, means=stats, **curve_options)
    frame = curves.to_frame()
    summary = curves.summary()
    means = summary["mean_delta_ppl"]
    windows = ", ".join(f"{c} {int(t.shape[0])}" for c, t in corpora.items())
    line = (
        "Mean ΔPPL over retention levels below 100%, least harmful order first: "
        + ", ".join(f"{o} {v:+.3g}" for o, v in sorted(means.items(), key=lambda kv: kv[1]))
        + f" (windows: {windows}; {curve_options['mode']} ablation of hook_z)."
    )
    return StageOutput(
        tables={
            "retention": frame,
            "comparison": curves.comparison(),
            "retention_summary": curves.summary_frame(),
        },
        figures={"retention": plot_retention(frame, title=title)},
        summary=[line],
        data={
            "orders": summary["orders"],
            "mean_delta_ppl": {
                f"{corpus}/{order}": value
                for corpus, per in summary["by_corpus"].items()
                for order, value in per.items()
            },
            "taxonomy_wins": summary["taxonomy_wins"],
            "retention": summary,
        },
    )


def pruning(
    model: Any,
    ref: Tokens,
    corpora: Mapping[str, Tokens],
    *,
    mode: HeadAblationMode = "zero",
    levels: Sequence[float] = RETENTION_LEVELS,
    sweep: bool = True,
    retention: bool = True,
    orders: Sequence[str] | None = None,
    task: tuple[str, Sequence[Any]] | None = None,
    k: float = 5.0,
    verify_heads: int = 0,
    seed: int = 0,
    batch_size: int = 8,
    sweep_checkpoint: str | Path | None = None,
    retention_checkpoint: str | Path | None = None,
    on_order: Callable[[pd.DataFrame], None] | None = None,
    verbose: bool = False,
    title: str = "",
) -> StageOutput:
    """Head pruning: per-head statistics of the reference windows ``ref`` (their taxonomy labels too, in
    the same passes, when the curves need them), the single-head sweep on ``ref`` (``sweep``), and with
    ``retention`` the curves of every head order on ``corpora`` (and ``task``). ``data``: the leaderboard,
    the taxonomy counts, the mean ΔPPL (or accuracy) per corpus and order, and the seconds of each part."""
    t0 = time.perf_counter()
    stats = head_stats(model, ref, batch_size=batch_size, taxonomy=retention, verbose=verbose)
    timings = {"head_stats_s": time.perf_counter() - t0}
    out = StageOutput(data={})
    result = None
    if sweep:
        t0 = time.perf_counter()
        result, part = single_head(
            model, ref, mode=mode, means=stats, k=k, verify_heads=verify_heads, batch_size=batch_size,
            checkpoint=sweep_checkpoint, verbose=verbose,
        )  # fmt: skip
        timings["sweep_s"] = time.perf_counter() - t0
        out.tables.update(part.tables)
        out.summary += part.summary
        out.data.update(part.data)
    counts = stats.summary().get("taxonomy_counts")
    if counts is not None:
        out.data["taxonomy_counts"] = counts
    out.tables["heads"] = head_table(model, stats, result)
    if retention:
        t0 = time.perf_counter()
        part = _retention(
            model, stats, result, corpora, orders=orders, seed=seed, title=title, levels=levels, mode=mode,
            task=task, batch_size=batch_size, checkpoint=retention_checkpoint, on_order=on_order,
            verbose=verbose,
        )  # fmt: skip
        timings["retention_s"] = time.perf_counter() - t0
        out.tables.update(part.tables)
        out.figures.update(part.figures)
        out.summary = part.summary + out.summary
        out.data.update(part.data)
    out.data["timings"] = timings
    return out
