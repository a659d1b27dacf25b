"""The faithfulness drivers: ΔPPL curves on windows, accuracy curves on task items, and the sentence-embedding
curves of an encoder (:mod:`mechgeom.analyses.faithfulness`), each with its figure, summary lines and
headline numbers. The report's faithfulness stages, ``mechgeom run faithfulness|encoder`` and ``mechgeom
sweep faithfulness|tasks`` call these functions.

Tables: ``curves`` (the entry point's table) and, for tasks, ``baselines`` (chance and majority rates per
task, :func:`mechgeom.analyses.scoring.task_baselines`). Figures: ``curves``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mechgeom.analyses.contribution.weights import RANKING_METRICS
from mechgeom.analyses.faithfulness import (
    FAITHFULNESS_METRICS,
    area_ordering,
    embedding_curves,
    faithfulness_summary,
    perplexity_curves,
    task_accuracy_curves,
)
from mechgeom.analyses.scoring import task_baselines
from mechgeom.hooks import MODES
from mechgeom.report.base import StageOutput
from mechgeom.sweep import Executor
from mechgeom.typing import Tokens
from mechgeom.viz import plot_curves

__all__ = ["embedding", "faithfulness_order", "perplexity", "tasks"]


def faithfulness_order(frame: pd.DataFrame, claimed: Sequence[str]) -> list[str]:
    """One sentence per mode wording :func:`mechgeom.analyses.faithfulness.faithfulness_summary`: the metrics
    by mean ΔPPL over the rates > 0 (most faithful first) and whether paper A's order ``claimed[0] <
    claimed[1] < ...`` (least to most faithful) holds, holds only up to ties (identical rankings), or fails."""
    summary = faithfulness_summary(frame, claimed=tuple(claimed))
    lines = []
    for mode, judged in summary["modes"].items():
        higher = judged["higher_is_more_faithful"]
        ranking = " > ".join(f"{m} ({v:+.3g})" for m, v in judged["ranking"])
        verdict = judged["verdict"]
        if verdict == "holds up to ties":
            ties = ", ".join(f"{a} = {b}" for a, b in judged["ties"])
            verdict = f"holds up to ties ({ties}: identical rankings)"
        lines.append(
            f"{mode} (mean ΔPPL over rates > 0; {'higher' if higher else 'lower'} = more faithful), most "
            f"faithful first: {ranking}. Paper A's order {' < '.join(claimed)}: {verdict} here."
        )
    return lines


def perplexity(
    model: Any,
    tokens: Tokens,
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float],
    modes: Sequence[str] = MODES,
    scope: str = "intra",
    seed: int = 0,
    n_boot: int = 1000,
    batch_size: int = 8,
    checkpoint: str | Path | None = None,
    executor: Executor | None = None,
    verbose: bool = False,
    title: str = "",
) -> StageOutput:
    """ΔPPL curves of ``tokens`` (:func:`~mechgeom.analyses.faithfulness.perplexity_curves`), their figure,
    paper A's claimed order judged per mode and, as ``data``, the orderings by area under the ΔPPL and ΔNLL
    curves (:func:`~mechgeom.analyses.faithfulness.area_ordering`)."""
    frame = perplexity_curves(
        model, tokens, metrics=metrics, rates=rates, modes=modes, scope=scope, batch_size=batch_size,
        seed=seed, n_boot=n_boot, checkpoint=checkpoint, executor=executor, verbose=verbose,
    )  # fmt: skip
    claimed = [m for m in RANKING_METRICS if m in metrics]
    judged = faithfulness_summary(frame, claimed=claimed)
    lines = faithfulness_order(frame, claimed)
    lines.append(
        f"Clean perplexity {judged['clean_ppl']:.2f} on {int(tokens.shape[0])} windows; rates {list(rates)}; "
        "bands are 95% bootstrap intervals over texts."
    )
    data = {
        "n_texts": int(tokens.shape[0]),
        "seq_len": int(tokens.shape[1]),
        "rates": list(rates),
        "metrics": list(metrics),
        "scope": scope,
        "layers": "all",
        "clean_ppl": judged["clean_ppl"],
        "ordering": area_ordering(frame, "delta_ppl"),
        "ordering_by_delta_nll": area_ordering(frame, "delta_nll"),
        "claimed_order": judged,
    }
    figure = plot_curves(frame, title=title)
    return StageOutput(tables={"curves": frame}, figures={"curves": figure}, summary=lines, data=data)


def tasks(
    model: Any,
    items: Sequence[Any],
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float],
    modes: Sequence[str] = ("comprehensiveness",),
    scope: str = "intra",
    seed: int = 0,
    batch_size: int = 8,
    max_len: int | None = None,
    checkpoint: str | Path | None = None,
    executor: Executor | None = None,
    verbose: bool = False,
    title: str = "",
) -> StageOutput:
    """Accuracy curves on task ``items`` (:func:`~mechgeom.analyses.faithfulness.task_accuracy_curves`), the
    tasks' chance and majority rates (table ``baselines``), the figure and the clean accuracy per task."""
    frame = task_accuracy_curves(
        model, items, metrics=metrics, rates=rates, modes=modes, scope=scope, batch_size=batch_size,
        seed=seed, max_len=max_len, checkpoint=checkpoint, executor=executor, verbose=verbose,
    )  # fmt: skip
    clean = frame.drop_duplicates("task").set_index("task")["clean_accuracy"].to_dict()
    data = {
        "metrics": list(metrics),
        "rates": list(rates),
        "modes": list(modes),
        "max_len": max_len,
        "scope": scope,
        "layers": "all",
        "clean_accuracy": clean,
    }
    lines = [f"Clean accuracy {', '.join(f'{t} {a:.1%}' for t, a in clean.items())}; rates {list(rates)}."]
    return StageOutput(
        tables={"curves": frame, "baselines": task_baselines(items)},
        figures={"curves": plot_curves(frame, title=title)},
        summary=lines,
        data=data,
    )


def embedding(
    model: Any,
    tokens: Tokens,
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float],
    scope: str = "intra",
    seed: int = 0,
    n_boot: int = 1000,
    batch_size: int = 8,
    checkpoint: str | Path | None = None,
    executor: Executor | None = None,
    verbose: bool = False,
    title: str = "",
) -> StageOutput:
    """An encoder's ``1 − cos`` curves of the sentence embedding
    (:func:`~mechgeom.analyses.faithfulness.embedding_curves`), their figure and paper A's order judged
    per mode by the area under each curve (``data``: the result's ``summary()`` and ``n_texts``)."""
    res = embedding_curves(
        model, tokens, metrics=metrics, rates=rates, scope=scope, seed=seed, n_boot=n_boot,
        batch_size=batch_size, checkpoint=checkpoint, executor=executor, verbose=verbose,
    )  # fmt: skip
    frame = res.to_frame()
    summ = res.summary()
    lines = []
    for mode, judged in summ["modes"].items():
        ranking = " > ".join(f"{m} ({v:.3g})" for m, v in judged["ranking"])
        lines.append(
            f"{mode} (area under 1 − cos vs rate; {'higher' if judged['higher_is_more_faithful'] else 'lower'} = "
            f"more faithful), most faithful first: {ranking}. Paper A's order "
            f"{' < '.join(summ['claimed'])}: {judged['verdict']} here."
        )
    lines.append(f"{res.n_texts} windows, rates {list(rates)}; bands are 95% bootstrap intervals over texts.")
    figure = plot_curves(frame, y="effect", title=title)
    data = {"n_texts": res.n_texts, **summ}
    return StageOutput(tables={"curves": frame}, figures={"curves": figure}, summary=lines, data=data)
