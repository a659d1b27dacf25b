"""Head orders for pruning (``docs/definitions.md`` §7.3–7.6) and the robust outlier flag of the critical heads.

**Orders** (lists of ``(layer, head)``, the first removed first; ties broken by ascending ``(layer, head)``):

- ``taxonomy``: Reset first, then Mixer, then Retriever; inside a regime ascending ``out_norm``;
- ``magnitude``: ascending ``‖W_V[h] W_O[h]‖_F`` (GQA: ``W_V`` of the head's KV group);
- ``entropy``: descending mean attention entropy (the least selective, most diffuse heads first);
  ``highest_first=False`` reverses it;
- ``random``: a seeded permutation;
- ``single_head``: ascending single-head ablation ``ΔPPL`` (the reference: least harmful first).

**Retention.** At retention ``r`` the model keeps ``n_kept = round_half_up(r * N)`` of its ``N`` heads and
removes the first ``N - n_kept`` heads of the order (:func:`retention_levels`); :func:`compare_orders` sets
the orders' retention curves side by side.

**Critical heads.** The single-head leaderboard flags a head as critical when
``ΔPPL > median + k * MAD`` over all heads, ``MAD = 1.4826 * median |ΔPPL - median|`` (the scaled MAD, a
consistent estimate of the standard deviation for normal data), ``k = 5`` (:func:`mad_outliers`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import pandas as pd
import torch

from mechgeom.analyses.heads.stats import HeadStats, weight_magnitude
from mechgeom.hooks import Head
from mechgeom.typing import Float, Tensor

__all__ = [
    "MAD_SCALE",
    "ORDERS",
    "REGIMES",
    "RETENTION_LEVELS",
    "compare_orders",
    "entropy_order",
    "head_orders",
    "head_table",
    "mad_outliers",
    "magnitude_order",
    "random_order",
    "retention_levels",
    "single_head_order",
    "taxonomy_order",
    "taxonomy_wins",
]

#: The taxonomy order's regimes, the first removed first.
REGIMES = ("Reset", "Mixer", "Retriever")
#: The orders :func:`head_orders` builds.
ORDERS = ("taxonomy", "magnitude", "entropy", "random", "single_head")
#: Scale that makes the MAD a consistent estimate of the standard deviation for normal data.
MAD_SCALE = 1.4826
#: 100%, 90%, ..., 10% of the heads kept.
RETENTION_LEVELS = tuple(k / 10 for k in range(10, 0, -1))


class SweepLike(Protocol):
    """What the single-head order reads of a :class:`~mechgeom.analyses.heads.pruning.SingleHeadResult`."""

    @property
    def nll(self) -> Float[Tensor, "layer head_index text"]: ...

    @property
    def delta_ppl(self) -> Float[Tensor, "layer head_index"]: ...


def all_heads(model: Any) -> list[Head]:
    return [
        (layer, head) for layer in range(int(model.cfg.n_layers)) for head in range(int(model.cfg.n_heads))
    ]


def _order_by(scores: Tensor | np.ndarray, *, descending: bool = False) -> list[Head]:
    """All heads sorted by ``scores[l, h]`` (ascending unless ``descending``), ties by ``(layer, head)``.

    >>> _order_by(np.array([[2.0, 1.0], [1.0, 0.5]]))
    [(1, 1), (0, 1), (1, 0), (0, 0)]
    """
    s = np.asarray(scores.detach().cpu() if isinstance(scores, Tensor) else scores, dtype=np.float64)
    if s.ndim != 2:
        raise ValueError(f"scores must be [layer, head], got shape {s.shape}")
    if np.isnan(s).any():
        raise ValueError("scores contain NaN; cannot order heads")
    keyed = sorted(np.ndindex(*s.shape), key=lambda lh: (-s[lh] if descending else s[lh], lh[0], lh[1]))
    return [(int(layer), int(head)) for layer, head in keyed]


def taxonomy_order(table: pd.DataFrame, head_norms: Tensor | np.ndarray | None = None) -> list[Head]:
    """Reset first, then Mixer, then Retriever; inside a regime by ascending mean head-output norm.

    ``table`` has one row per head with at least ``layer, head, label`` (e.g.
    ``taxonomy.classify_heads(...).to_frame()``). The norm comes from ``head_norms[layer, head]`` (e.g.
    ``head_stats(...).out_norm``) or, when that is None, from a column ``out_norm`` of the table. Ties are
    broken by ``(layer, head)``. Raises ``ValueError`` for missing columns, unknown labels or duplicate heads.
    """
    missing = {"layer", "head", "label"} - set(table.columns)
    if missing:
        raise ValueError(f"taxonomy table lacks column(s) {sorted(missing)}")
    df = table[["layer", "head", "label"]].copy()
    df["layer"] = df["layer"].astype(int)
    df["head"] = df["head"].astype(int)
    if head_norms is not None:
        norms = np.asarray(head_norms.detach().cpu() if isinstance(head_norms, Tensor) else head_norms)
        df["norm"] = norms[df["layer"].to_numpy(), df["head"].to_numpy()]
    elif "out_norm" in table.columns:
        df["norm"] = table["out_norm"].to_numpy(dtype=float)
    else:
        raise ValueError("give head_norms (e.g. head_stats(...).out_norm) or an 'out_norm' column")
    unknown = sorted(set(df["label"]) - set(REGIMES))
    if unknown:
        raise ValueError(f"unknown taxonomy label(s) {unknown}; expected {list(REGIMES)}")
    if df.duplicated(["layer", "head"]).any():
        raise ValueError("the taxonomy table lists a head twice")
    if df["norm"].isna().any():
        raise ValueError("head-output norms contain NaN")
    df["regime"] = df["label"].map({label: k for k, label in enumerate(REGIMES)})
    df = df.sort_values(["regime", "norm", "layer", "head"], kind="mergesort")
    return [(int(layer), int(head)) for layer, head in zip(df["layer"], df["head"], strict=True)]


def magnitude_order(model: Any) -> list[Head]:
    """Ascending ``‖W_V[h] W_O[h]‖_F`` (:func:`~mechgeom.analyses.heads.stats.weight_magnitude`): the smallest is removed first."""
    return _order_by(weight_magnitude(model))


def entropy_order(entropy: HeadStats | Tensor, *, highest_first: bool = True) -> list[Head]:
    """By mean attention entropy (:func:`~mechgeom.analyses.heads.stats.head_stats`); by default the highest
    (least selective) first."""
    ent = entropy.entropy if isinstance(entropy, HeadStats) else entropy
    return _order_by(ent, descending=highest_first)


def random_order(model: Any, seed: int = 0) -> list[Head]:
    """A uniformly random permutation of all heads, reproducible from ``seed`` (numpy ``default_rng``)."""
    heads = all_heads(model)
    perm = np.random.default_rng(seed).permutation(len(heads))
    return [heads[k] for k in perm]


def single_head_order(sweep: SweepLike) -> list[Head]:
    """Ascending single-head ablation ``ΔPPL``: the head whose removal alone hurts least goes first."""
    if torch.isnan(sweep.nll).any():
        raise ValueError("the sweep did not cover every head; run single_head_sweep with heads=None")
    return _order_by(sweep.delta_ppl)


def head_orders(
    model: Any,
    stats: HeadStats,
    *,
    taxonomy: pd.DataFrame | None = None,
    sweep: SweepLike | None = None,
    seed: int = 0,
    entropy_highest_first: bool = True,
) -> dict[str, list[Head]]:
    """Every order that the inputs allow: magnitude, entropy, random always; taxonomy and single_head if given.

    The taxonomy order uses ``taxonomy`` (a per-head label table) or, when that is None, the labels that
    :func:`~mechgeom.analyses.heads.stats.head_stats` collected in the same passes (``stats.taxonomy``).
    """
    orders: dict[str, list[Head]] = {}
    if taxonomy is None and stats.taxonomy is not None:
        taxonomy = stats.taxonomy.to_frame()
    if taxonomy is not None:
        orders["taxonomy"] = taxonomy_order(taxonomy, stats.out_norm)
    orders["magnitude"] = magnitude_order(model)
    orders["entropy"] = entropy_order(stats, highest_first=entropy_highest_first)
    orders["random"] = random_order(model, seed)
    if sweep is not None:
        orders["single_head"] = single_head_order(sweep)
    return orders


def head_table(model: Any, stats: HeadStats, sweep: SweepLike | None = None) -> pd.DataFrame:
    """What the orders are built from, one row per head: ``layer, head, out_norm, entropy,
    weight_magnitude`` and, when given, the single-head ``delta_ppl`` and the taxonomy ``label``."""
    table = stats.to_frame()
    table["weight_magnitude"] = weight_magnitude(model).flatten().numpy()
    if sweep is not None:
        table["delta_ppl"] = sweep.delta_ppl.flatten().numpy()
    if stats.taxonomy is not None:
        labels = stats.taxonomy.to_frame()[["layer", "head", "label"]]
        table = table.merge(labels.drop_duplicates(["layer", "head"]), on=["layer", "head"], how="left")
    return table


# --------------------------------------------------------------------------- retention


def retention_levels(n_heads: int, levels: Sequence[float] = RETENTION_LEVELS) -> list[tuple[float, int]]:
    """``(retention, n_kept)`` with ``n_kept = floor(retention * n_heads + 1/2)`` (round half up).

    >>> retention_levels(72)[:3]
    [(1.0, 72), (0.9, 65), (0.8, 58)]
    """
    out = []
    for r in levels:
        if not 0 <= r <= 1:
            raise ValueError(f"retention must be in [0, 1], got {r}")
        out.append((float(r), math.floor(r * n_heads + 0.5 + 1e-9)))
    return out


def compare_orders(frame: pd.DataFrame) -> pd.DataFrame:
    """Per corpus/task and retention < 100% of a retention frame
    (:func:`~mechgeom.analyses.heads.pruning.retention_curves`): each order's PPL (or accuracy) side by side and
    the ``best`` order (lowest PPL, highest accuracy; the first order on ties)."""
    rows = []
    below = frame[frame["retention"] < 1.0]
    for (corpus, retention), grp in below.groupby(["corpus", "retention"], sort=False):
        is_task = grp["ppl"].isna().all()
        metric = "accuracy" if is_task else "ppl"
        vals = dict(zip(grp["order"], grp[metric], strict=True))
        best = (max if is_task else min)(vals, key=vals.__getitem__)
        rows.append({"corpus": corpus, "retention": retention, "metric": metric, **vals, "best": best})
    return pd.DataFrame(rows)


def taxonomy_wins(comparison: pd.DataFrame) -> dict[str, Any]:
    """From :func:`compare_orders`: per corpus/task and baseline, the retention levels where the taxonomy
    order does better (lower PPL, higher accuracy) and the number of levels; ``{}`` without a taxonomy order."""
    out: dict[str, Any] = {}
    if "taxonomy" not in comparison.columns:
        return out
    for corpus, grp in comparison.groupby("corpus", sort=False):
        higher_better = grp["metric"].iloc[0] == "accuracy"
        per: dict[str, Any] = {}
        for base in ("magnitude", "entropy", "random", "single_head"):
            if base not in grp.columns:
                continue
            better = grp["taxonomy"] > grp[base] if higher_better else grp["taxonomy"] < grp[base]
            per[base] = {
                "taxonomy_better_at": [float(r) for r in grp.loc[better, "retention"]],
                "n_levels": len(grp),
            }
        out[str(corpus)] = per
    return out


# --------------------------------------------------------------------------- critical heads


def mad_outliers(values: Tensor | np.ndarray, *, k: float = 5.0, scale: float = MAD_SCALE) -> dict[str, Any]:
    """Robust outlier flag: ``x > median + k * MAD`` with ``MAD = scale * median |x - median|``.

    ``scale = 1.4826`` makes the MAD a consistent estimate of the standard deviation for normal data.
    Returns ``flags`` (bool array), ``threshold``, ``median``, ``mad`` (scaled) and ``robust_z``
    (``(x - median) / MAD``; ``inf``/NaN where ``MAD = 0``). With ``MAD = 0`` every value above the
    median is flagged. NaNs are ignored for the median and never flagged.

    >>> mad_outliers(np.array([1.0, 1.1, 0.9, 1.0, 9.0]))["flags"].tolist()
    [False, False, False, False, True]
    """
    x = np.asarray(values.detach().cpu() if isinstance(values, Tensor) else values, dtype=np.float64)
    if np.isnan(x).all():
        raise ValueError("no finite values to flag")
    med = float(np.nanmedian(x))
    mad = scale * float(np.nanmedian(np.abs(x - med)))
    threshold = med + k * mad
    with np.errstate(divide="ignore", invalid="ignore"):
        robust_z = (x - med) / mad
    return {
        "flags": np.nan_to_num(x, nan=-np.inf) > threshold,
        "threshold": threshold,
        "median": med,
        "mad": mad,
        "robust_z": robust_z,
    }
