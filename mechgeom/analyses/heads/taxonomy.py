"""Parameter-free head taxonomy (``docs/definitions.md`` §6, paper B): Retriever, Mixer, Reset.

For each head and query ``i``, the *source winner* is ``w_i = argmax_{j<=i} alpha[h,i,j] * ‖v[j,h]‖``
(value space, GQA-expanded ``v``). Over the queries ``i > max(sink_positions)`` (``i >= 1`` with the
default sink at 0): ``f_cur = mean[w_i = i]``, ``f_sink = mean[w_i ∈ sinks]``,
``f_other = 1 − f_cur − f_sink``. A head is a **Retriever** if ``f_cur`` is the largest, a **Mixer**
if ``f_sink`` is, a **Reset** otherwise.

Choices fixed here:

- **Ties in the winner**: the lower position wins (``torch.argmax`` returns the first maximum).
- **Ties between fractions**: Retriever before Mixer before Reset (``f_cur >= f_sink, f_other`` gives
  Retriever; else ``f_sink >= f_other`` gives Mixer; else Reset).
- **Counts pool** every text and query of the analysed batch(es); the per-head table's columns
  ``layer, head, label, f_cur, f_sink, f_other, sink_rate`` are stable (pruning imports them).
- **Alignment**: ``cos_out_sink = mean_i cos(o[i,h], vt[s,h])`` with ``s`` the first sink position and
  ``cos_out_cur = mean_i cos(o[i,h], vt[i,h])`` (``o[i,h] = z[i,h] @ W_O[h]``, ``vt = v @ W_O``,
  bias excluded); zero norms are left out of the means.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Unpack

import einops
import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import warn_deprecated
from mechgeom.analyses.base import Collector, PassOptions, Result, entry_point, run_collector
from mechgeom.hooks import (
    LayerActivations,
    Queries,
    TokensOrText,
    align_texts,
    check_sink_positions,
    head_outputs,
    modified_pairs,
    text_spans,
    texts_first,
    to_batch,
)
from mechgeom.typing import WO, Bool, Float, Int, Pattern, Tensor, Tokens, Values, Z

__all__ = [
    "LABELS",
    "TABLE_COLUMNS",
    "AgreementResult",
    "TaxonomyCollector",
    "TaxonomyResult",
    "classify_heads",
    "classify_heads_from_cache",
    "label_agreement",
    "label_distribution",
    "label_from_fractions",
    "layer_taxonomy",
    "regime_summary",
    "source_winners",
]

#: The three regimes, in tie-break order.
LABELS = ("Retriever", "Mixer", "Reset")
#: The stable leading columns of :meth:`TaxonomyResult.to_frame`.
TABLE_COLUMNS = ("layer", "head", "label", "f_cur", "f_sink", "f_other", "sink_rate")
#: Figure colours per regime.
REGIME_COLORS = {"Retriever": "#d62728", "Mixer": "#1f77b4", "Reset": "#bbbbbb"}

_SUMS = (
    "n_queries",
    "n_cur",
    "n_sink",
    "sink_mass",
    "cos_sink_sum",
    "cos_sink_n",
    "cos_cur_sum",
    "cos_cur_n",
    "n_modified",
)


def source_winners(pattern: Pattern, v: Values) -> Int[Tensor, "batch head_index query_pos"]:
    """Source winner ``w_i = argmax_{j<=i} alpha[h,i,j] * ‖v[j,h]‖`` (ties: the lower position).

    ``v`` is the GQA-expanded ``hook_v``, ``[batch, pos, head_index, d_head]``.

    >>> pat = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])
    >>> v = torch.tensor([[[[1.0]], [[2.0]]]])
    >>> source_winners(pat, v).tolist()
    [[[0, 1]]]
    """
    if pattern.ndim != 4 or v.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        raise ValueError(
            f"need pattern [b, h, q, k] (q == k) and v [b, k, h, d]; got {tuple(pattern.shape)}, {tuple(v.shape)}"
        )
    b, h, _, k = pattern.shape
    if tuple(v.shape[:3]) != (b, k, h):
        raise ValueError(
            f"v {tuple(v.shape)} does not match pattern {tuple(pattern.shape)}; expand GQA values first"
        )
    norm = einops.rearrange(v.norm(dim=-1), "b k h -> b h k")
    score = pattern * norm[:, :, None, :]  # [b h q k]
    causal = torch.ones(k, k, dtype=torch.bool, device=pattern.device).tril()
    score = score.masked_fill(~causal, float("-inf"))
    return score.argmax(dim=-1)


def label_from_fractions(f_cur: float, f_sink: float, f_other: float) -> str:
    """Retriever if ``f_cur`` is the largest, Mixer if ``f_sink`` is, Reset otherwise.

    Ties go to the earlier of Retriever, Mixer, Reset:

    >>> label_from_fractions(0.4, 0.4, 0.2), label_from_fractions(0.2, 0.4, 0.4), label_from_fractions(0.2, 0.3, 0.5)
    ('Retriever', 'Mixer', 'Reset')
    """
    if any(np.isnan(x) for x in (f_cur, f_sink, f_other)):
        raise ValueError("fractions are NaN: the head had no query to classify")
    if f_cur >= f_sink and f_cur >= f_other:
        return "Retriever"
    if f_sink >= f_other:
        return "Mixer"
    return "Reset"


def layer_taxonomy(
    pattern: Pattern,
    v: Values,
    z: Z | None = None,
    W_O: WO | None = None,
    *,
    sink_positions: int | Sequence[int] | None = None,
    modified: Bool[Tensor, "batch head_index query_pos"] | None = None,
    keep: Bool[Tensor, "batch query_pos"] | None = None,
) -> dict[str, Tensor]:
    """Per-head sums for one layer: winner counts, sink mass and (with ``z``, ``W_O``) alignments.

    Returns ``{name: [head_index]}`` for ``n_queries, n_cur, n_sink, sink_mass, cos_sink_sum, cos_sink_n,
    cos_cur_sum, cos_cur_n, n_modified`` plus ``winners`` ``[batch, head, query_pos]`` (``-1`` for the
    queries that are not classified). Sums (not means), so several batches add up.

    ``modified`` marks the ``(batch, head, query)`` whose ``z`` an earlier hook changed
    (:func:`mechgeom.hooks.modified_mask`): winners still come from ``alpha`` and ``v`` (what the model
    computed), ``n_modified`` counts those queries, and their output alignments (which would mix the
    changed ``z`` with the unchanged values) are left out of the ``cos_*`` sums.

    ``keep`` (``[batch, query_pos]``, default every query) is the queries counted: padding and the queries
    left out by ``queries=`` are False there (:func:`mechgeom.hooks.align_texts` gives it for a padded batch,
    each text moved to the start of its row). Only the rows of queries kept in some text are computed.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 60 lines.
    if pattern.ndim != 4 or v.ndim != 4 or pattern.shape[-1] != pattern.shape[-2]:
        source_winners(pattern, v)  # raises with the shapes
    b, h, _, k = pattern.shape
    sinks = check_sink_positions(sink_positions, k)
    first = max(sinks) + 1
    if first >= k:
        raise ValueError(f"no query after the sink position(s) {list(sinks)} in sequences of {k} positions")
    dev = pattern.device
    counted = torch.ones(b, k, dtype=torch.bool) if keep is None else keep.detach().cpu().bool().clone()
    counted[:, :first] = False
    rows = counted.any(0).nonzero().flatten()  # queries kept in some text: the only rows computed
    sel = counted[:, rows].to(dev)  # [b r]
    rows = rows.to(dev)
    pat = pattern[:, :, rows]  # [b h r k]
    norm = einops.rearrange(v.norm(dim=-1), "b k h -> b h k")
    score = pat * norm[:, :, None, :]
    visible = torch.arange(k, device=dev)[None, :] <= rows[:, None]  # [r k]: j <= i
    w = score.masked_fill(~visible, float("-inf")).argmax(dim=-1)  # [b h r]; ties: the lower position
    sel_h = sel[:, None, :].expand_as(w)
    is_sink = torch.zeros_like(w, dtype=torch.bool)
    for s in sinks:
        is_sink |= w == s
    mass = pat[..., list(sinks)].sum(-1)
    sums: dict[str, Tensor] = {
        "n_queries": torch.full((h,), float(sel.sum()), dtype=torch.float64),
        "n_cur": ((w == rows) & sel_h).sum(dim=(0, 2)).double(),
        "n_sink": (is_sink & sel_h).sum(dim=(0, 2)).double(),
        "sink_mass": torch.where(sel_h, mass, 0.0).sum(dim=(0, 2)).double(),
    }
    if z is not None and W_O is not None:
        o = head_outputs(z[:, rows], W_O).double()  # [b r h m]
        vt = head_outputs(v, W_O).double()  # [b k h m]
        o_norm = o.norm(dim=-1)
        sink_vt = vt[:, sinks[0]]  # [b h m]
        cos_sink = einops.einsum(o, sink_vt, "b q h m, b h m -> b q h") / (
            o_norm * sink_vt.norm(dim=-1)[:, None]
        )
        cur_vt = vt[:, rows]
        cos_cur = (o * cur_vt).sum(-1) / (o_norm * cur_vt.norm(dim=-1))
        kept = sel[:, :, None].expand_as(o_norm)  # [b q h]
        if modified is not None:
            kept = kept & ~einops.rearrange(modified[:, :, rows], "b h q -> b q h")
        for name, c in (("cos_sink", cos_sink), ("cos_cur", cos_cur)):
            ok = torch.isfinite(c) & kept
            sums[f"{name}_sum"] = torch.where(ok, c, 0.0).sum(dim=(0, 1))
            sums[f"{name}_n"] = ok.sum(dim=(0, 1)).double()
    else:
        for name in ("cos_sink_sum", "cos_sink_n", "cos_cur_sum", "cos_cur_n"):
            sums[name] = torch.zeros(h, dtype=torch.float64)
    n_mod = (
        torch.zeros(h, dtype=torch.float64)
        if modified is None
        else (modified[:, :, rows] & sel_h).sum((0, 2))
    )
    sums["n_modified"] = n_mod.double()
    out = {key: t.cpu() for key, t in sums.items()}
    winners = torch.full((b, h, k), -1, dtype=w.dtype)
    winners[:, :, rows.cpu()] = torch.where(sel_h, w, -1).cpu()
    out["winners"] = winners
    return out


@dataclass
class TaxonomyResult(Result):
    """Winner counts of every analysed head; :meth:`to_frame` gives the per-head table.

    ``sums[name]`` is ``[layer, head_index]`` (see :func:`layer_taxonomy`); ``winners`` (kept on request)
    is ``[batch, layer, head_index, query_pos]``; ``tokens`` the texts given to the collector's
    :meth:`~TaxonomyCollector.result` (``None`` from a cache without them).
    """

    layers: list[int]
    sums: dict[str, Float[Tensor, "layer head_index"]]
    sink_positions: tuple[int, ...] = (0,)
    winners: Int[Tensor, "batch layer head_index query_pos"] | None = None
    model_name: str = ""
    corpus: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    tokens: Tokens | None = None

    def fractions(self) -> dict[str, Float[Tensor, "layer head_index"]]:
        """``f_cur``, ``f_sink``, ``f_other`` and ``sink_rate`` per head."""
        n = self.sums["n_queries"]
        f_cur, f_sink = self.sums["n_cur"] / n, self.sums["n_sink"] / n
        return {
            "f_cur": f_cur,
            "f_sink": f_sink,
            "f_other": 1 - f_cur - f_sink,
            "sink_rate": self.sums["sink_mass"] / n,
        }

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs whose ``z`` an earlier hook changed at some analysed query."""
        n_mod = self.sums.get("n_modified")
        return [] if n_mod is None else modified_pairs((n_mod > 0)[None, :, :, None], self.layers)

    def to_frame(self) -> pd.DataFrame:
        """One row per head: ``layer, head, label, f_cur, f_sink, f_other, sink_rate, cos_out_sink,
        cos_out_cur, n_queries, modified`` (the first seven are stable; ``modified`` is ``True`` for a head
        whose ``z`` an earlier hook changed, see :func:`layer_taxonomy`)."""
        fr = self.fractions()
        n_l, n_h = fr["f_cur"].shape
        ll, hh = torch.meshgrid(torch.arange(n_l), torch.arange(n_h), indexing="ij")
        cols = {k: t.flatten().numpy() for k, t in fr.items()}
        df = pd.DataFrame(
            {
                "layer": np.asarray(self.layers)[ll.flatten().numpy()],
                "head": hh.flatten().numpy(),
                "label": [
                    label_from_fractions(*x)
                    for x in zip(cols["f_cur"], cols["f_sink"], cols["f_other"], strict=True)
                ],
                **cols,
            }
        )
        with np.errstate(invalid="ignore", divide="ignore"):
            df["cos_out_sink"] = (self.sums["cos_sink_sum"] / self.sums["cos_sink_n"]).flatten().numpy()
            df["cos_out_cur"] = (self.sums["cos_cur_sum"] / self.sums["cos_cur_n"]).flatten().numpy()
        df["n_queries"] = self.sums["n_queries"].flatten().numpy().astype(np.int64)
        n_mod = self.sums.get("n_modified")
        df["modified"] = False if n_mod is None else (n_mod > 0).flatten().numpy()
        if self.corpus:
            df["corpus"] = self.corpus
        return df

    def summary(self) -> dict[str, Any]:
        """The headline numbers of :func:`regime_summary` of :meth:`to_frame`, JSON-serialisable.

        ``shares`` and ``counts`` (``{label: ...}`` for the three :data:`LABELS`, 0 when absent), ``n_heads``,
        ``cos_out_sink_mixer`` (Mixers' outputs vs the sink value) and ``cos_out_cur_retriever``
        (Retrievers' outputs vs the current token's value), each NaN when the regime has no head,
        ``alignment`` (per label: ``cos_out_sink``, ``cos_out_cur``, ``sink_rate``) and ``corpus``.
        """
        table = self.to_frame()
        regimes = regime_summary(table).set_index("label")
        col: dict[str, dict[Any, Any]] = {c: regimes[c].to_dict() for c in regimes.columns}
        align = ("cos_out_sink", "cos_out_cur", "sink_rate")
        return {
            "corpus": self.corpus,
            "n_heads": len(table),
            "shares": {lab: float(col["share"][lab]) for lab in LABELS},
            "counts": {lab: int(col["n_heads"][lab]) for lab in LABELS},
            "cos_out_sink_mixer": float(col["cos_out_sink"]["Mixer"]),
            "cos_out_cur_retriever": float(col["cos_out_cur"]["Retriever"]),
            "alignment": [{"label": lab, **{c: float(col[c][lab]) for c in align}} for lab in LABELS],
        }


class TaxonomyCollector(Collector):
    """Hook collector (on :class:`mechgeom.hooks.LayerCollector`) that accumulates winner counts.

    ``fwd_hooks`` read ``hook_pattern``, ``hook_v`` and ``hook_z``; counts add up over as many forward
    passes (or :meth:`feed_cache` calls) as you like; :meth:`result` returns a :class:`TaxonomyResult`.
    ``corpus`` labels the result (a ``corpus`` column of its table when not empty).

    Padding (``LayerActivations.key_mask``, left or right) is never a query, a source or a sink: each text
    is moved to the start of its row (:func:`mechgeom.hooks.align_texts`), so ``sink_positions`` and the
    query axis of ``winners`` are positions inside each text and the counts are those of the texts run
    alone, pooled. ``queries`` (:func:`mechgeom.hooks.select_queries`) keeps some queries of each text.
    """

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        sink_positions: int | Sequence[int] | None = None,
        keep_winners: bool = False,
        corpus: str = "",
        queries: Queries = None,
    ) -> None:
        super().__init__(model, layers)
        self.sink_positions = check_sink_positions(sink_positions)
        self.queries = queries
        self._offset: dict[int, int] = {}
        self._starts: list[Tensor] = []  # each batch's first real positions (left padding)
        self.keep_winners = keep_winners
        self.corpus = str(corpus)
        self._sums: dict[int, dict[str, Tensor]] = {}
        self._winners: dict[int, list[Tensor]] = {la: [] for la in self.layers}

    def on_layer(self, acts: LayerActivations) -> None:
        offset = self._offset.get(acts.layer, 0)
        self._offset[acts.layer] = offset + int(acts.pattern.shape[0])
        with torch.no_grad():
            al = align_texts(acts, self.queries, offset)  # each text at the start of its row
            res = layer_taxonomy(
                al.acts.pattern,
                al.acts.v,
                al.acts.z,
                al.acts.W_O,
                sink_positions=self.sink_positions,
                modified=al.acts.modified,
                keep=al.keep & al.real,
            )
        if acts.layer == self.layers[0]:
            self._starts.append(text_spans(acts.key_mask, *al.keep.shape)[0])
        winners = res.pop("winners")
        if self.keep_winners:
            self._winners[acts.layer].append(winners)
        prev = self._sums.get(acts.layer)
        self._sums[acts.layer] = res if prev is None else {k: prev[k] + res[k] for k in res}

    def build(self, tokens: Tokens | None) -> TaxonomyResult:
        """The pooled counts of every pass so far; ``tokens`` (the texts analysed) are kept on the result."""
        sums = {k: torch.stack([self._sums[la][k] for la in self.layers]) for k in _SUMS}
        winners = None
        if self.keep_winners:
            winners = torch.stack([torch.cat(self._winners[la]) for la in self.layers], dim=1)
        return TaxonomyResult(
            layers=list(self.layers),
            sums=sums,
            sink_positions=self.sink_positions,
            winners=winners,
            model_name=self.model_name,
            corpus=self.corpus,
            tokens=texts_first(tokens, self._starts),  # positions inside each text, as winners
        )


@entry_point
def classify_heads(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
    batch_size: int = 8,
    keep_winners: bool = False,
    corpus: str = "",
    queries: Queries = None,
    **run: Unpack[PassOptions],
) -> TaxonomyResult:
    """Label every head of ``layers`` Retriever, Mixer or Reset from its source winners.

    Args:
        model: a causal decoder.
        tokens_or_text: text, texts or token ids (the cached texts with ``cache``, optional there).
        layers: an int or a sequence of ints; ``None`` is every layer.
        sink_positions: the sink set of ``f_sink``, positions inside each text (default the first position).
        batch_size: texts per forward pass (the counts add up over passes; padding is never counted, so they
            are those of the texts run alone, pooled).
        keep_winners: keep every query's winner (``[text, layer, head, query]``) on the result.
        corpus: a label for the result's table.
        queries: the queries counted (:func:`mechgeom.hooks.select_queries`: positions inside each text,
            ``-1`` its last token; a slice; a boolean mask); ``None`` counts every real query after the sinks.

    Returns:
        A :class:`TaxonomyResult`.
    """
    col = TaxonomyCollector(
        model,
        layers,
        sink_positions=sink_positions,
        keep_winners=keep_winners,
        corpus=corpus,
        queries=queries,
    )
    what = "the taxonomy (a query after the sink)"
    if run["cache"] is None and tokens_or_text is not None:
        tokens, mask = to_batch(
            model, tokens_or_text, attention_mask=run["attention_mask"], min_pos=2, what=what
        )
        longest = int(tokens.shape[1]) if mask is None else int(mask.sum(-1).max())
        sinks = check_sink_positions(sink_positions, tokens.shape[1])
        if max(sinks) + 1 >= longest:
            raise ValueError(
                f"the taxonomy needs a query after the sink position(s) {list(sinks)}: "
                f"texts of at most {longest} real positions have none"
            )
        tokens_or_text, run["attention_mask"] = tokens, mask
    return run_collector(  # type: ignore[no-any-return]
        model, tokens_or_text, col, batch_size=batch_size, desc="taxonomy", min_pos=2, what=what, **run
    )


def classify_heads_from_cache(
    model: Any,
    cache: Any,
    *,
    layers: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
    keep_winners: bool = False,
    tokens: Tokens | None = None,
    corpus: str = "",
) -> TaxonomyResult:
    """Deprecated: ``classify_heads(model, tokens, cache=cache, ...)`` gives the same labels."""
    warn_deprecated("classify_heads_from_cache(model, cache)", "classify_heads(model, tokens, cache=cache)")
    return classify_heads(
        model,
        tokens,
        layers=layers,
        cache=cache,
        sink_positions=sink_positions,
        keep_winners=keep_winners,
        corpus=corpus,
    )


# --------------------------------------------------------------------------- tables


def check_table(table: pd.DataFrame) -> None:
    missing = [c for c in ("layer", "head", "label") if c not in table.columns]
    if missing:
        raise ValueError(f"label table lacks column(s) {missing}; use TaxonomyResult.to_frame()")


def label_distribution(table: pd.DataFrame, *, by: str | Sequence[str] | None = None) -> pd.DataFrame:
    """Count and share of each label (all three listed, zeros included), optionally per group ``by``."""
    check_table(table)
    keys = [] if by is None else ([by] if isinstance(by, str) else list(by))
    rows = []
    groups = [((), table)] if not keys else table.groupby(keys)
    for key, g in groups:
        key_t = key if isinstance(key, tuple) else (key,)
        counts = g["label"].value_counts()
        for label in LABELS:
            n = int(counts.get(label, 0))
            rows.append(
                {**dict(zip(keys, key_t, strict=True)), "label": label, "n_heads": n, "share": n / len(g)}
            )
    return pd.DataFrame(rows)


def regime_summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per regime: number and share of heads, mean fractions, sink rate and output alignments.

    ``cos_out_sink`` is expected high for Mixers, ``cos_out_cur`` for Retrievers.
    """
    check_table(table)
    cols = [
        c for c in ("f_cur", "f_sink", "f_other", "sink_rate", "cos_out_sink", "cos_out_cur") if c in table
    ]
    out = table.groupby("label")[cols].mean().reindex(list(LABELS))
    out.insert(0, "n_heads", table["label"].value_counts().reindex(list(LABELS)).fillna(0).astype(int))
    out.insert(1, "share", out["n_heads"] / len(table))
    return out.reset_index()


@dataclass
class AgreementResult(Result):
    """Label agreement between corpora: ``pairwise`` (one row per pair), ``all_agree`` (share of heads
    with the same label in every table) and ``confusion[(a, b)]`` (rows: labels in ``a``, columns: in
    ``b``)."""

    pairwise: pd.DataFrame
    all_agree: float
    confusion: dict[tuple[str, str], pd.DataFrame]

    def to_frame(self) -> pd.DataFrame:
        """One row per pair of tables: ``a, b, n_heads, agreement``."""
        return self.pairwise.copy()

    def summary(self) -> dict[str, Any]:
        """``{"pairwise": [one record per pair: a, b, n_heads, agreement], "all_agree": share}``."""
        return {"pairwise": self.pairwise.to_dict(orient="records"), "all_agree": float(self.all_agree)}


def label_agreement(tables: Mapping[str, pd.DataFrame] | Sequence[pd.DataFrame]) -> AgreementResult:
    """Agreement of head labels between two or more tables over the same ``(layer, head)`` set."""
    named = dict(tables) if isinstance(tables, Mapping) else {f"t{i}": t for i, t in enumerate(tables)}
    if len(named) < 2:
        raise ValueError(f"need at least two label tables, got {len(named)}")
    labels: dict[str, pd.Series] = {}
    ref: set[tuple[int, int]] | None = None
    for name, t in named.items():
        check_table(t)
        s = t.set_index(["layer", "head"])["label"]
        if not s.index.is_unique:
            raise ValueError(f"table {name!r} has duplicate (layer, head) rows")
        keys = set(s.index)
        if ref is None:
            ref = keys
        elif keys != ref:
            raise ValueError(f"table {name!r} covers other (layer, head) pairs than the first table")
        labels[name] = s
    names = list(labels)
    index = labels[names[0]].index
    aligned = pd.DataFrame({n: labels[n].reindex(index).to_numpy() for n in names}, index=index)
    rows, confusion = [], {}
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            rows.append(
                {
                    "a": a,
                    "b": b,
                    "n_heads": len(aligned),
                    "agreement": float((aligned[a] == aligned[b]).mean()),
                }
            )
            confusion[(a, b)] = (
                pd.crosstab(
                    pd.Categorical(aligned[a], LABELS), pd.Categorical(aligned[b], LABELS), dropna=False
                )
                .rename_axis(index=a, columns=b)
                .astype(int)
            )
    all_agree = float((aligned.nunique(axis=1) == 1).mean())
    return AgreementResult(pd.DataFrame(rows), all_agree, confusion)
