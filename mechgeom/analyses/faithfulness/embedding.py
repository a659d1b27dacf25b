"""Faithfulness without a language-model head: paper A's source masking on an encoder (``docs/definitions.md`` §3.6).

A decoder's faithfulness is ΔPPL of next-token prediction (:mod:`mechgeom.analyses.faithfulness.curves`); an
encoder (BERT-style, bidirectional attention, e.g. ``"minilm-l6"``) predicts no next token. Its outcome is
the **sentence embedding** ``e``: the final hidden states mean-pooled over the real (non-padding) tokens
(sentence-transformers' pooling, :func:`mechgeom.models.encoders.sentence_embedding`). Definition:

- **Effect.** "``effect = 1 − cos(e_masked, e_clean)`` per text (0 = no change)", in ``[0, 2]`` (clamped
  there against rounding; NaN where an embedding is the zero vector). A curve is the mean effect over
  texts at each removal rate, with a 95% percentile bootstrap over texts
  (:func:`mechgeom.analyses.scoring.bootstrap_ci`).
- **Removal.** As for decoders: "removing source ``j`` from query ``i`` = setting ``alpha[h,i,j] = 0``
  **without renormalising**, as a hook on ``hook_pattern``", at every chosen layer at once
  (:func:`mechgeom.hooks.masking_hooks`); the ranking comes from one clean pass and is never re-ranked.
  Where the model discards ``hook_pattern`` edits (TransformerLens 4's BERT bridge fires the hook after
  HF's attention has run; 3.x bridges ignore the edit; the model's adapter probes it), the same removal
  is made at ``hook_z``: ``z[i,h] − sum_j alpha[h,i,j] v[j,h]`` over the removed ``j``, with ``alpha``
  recomputed from ``hook_q``/``hook_k`` of that pass and checked against ``hook_pattern`` every time.
- **Sources and counting.** An encoder's query sees every key, so the sources of a real query ``i`` of a
  text with ``n`` real tokens are those ``n`` keys (not ``j <= i``). At rate ``r``,
  ``n_i = ceil(round(r * n, 9))`` sources are removed (rounded as for decoders, so ``0.3 * 10`` counts 3):
  the top-ranked (**comprehensiveness**: a larger effect is more faithful) or the bottom-ranked
  (**sufficiency**: a smaller effect is more faithful). Rate 0 removes nothing, so its effect is exactly 0
  (no pass is run); comprehensiveness at rate 1 removes every real source of every real query.
- **Ranking.** By the signed metric of :mod:`mechgeom.analyses.contribution.weights` (``scope="intra"``: one ranking
  per head; ``"inter"``: one per layer for all heads), largest first, stable (ties to the lower position),
  NaN below every finite value (:func:`mechgeom.hooks.rank_sources` with ``causal=False``).
- **Padding.** Padded keys (attention mask 0) are neither sources nor queries: they rank after every real
  key and are never removed; padded queries remove nothing. Their pattern is 0 anyway and the pooling skips
  them, so a text in a padded batch has the effect it has alone.
- **Random control.** ``"random"`` ranks by uniform noise over the real tokens, seeded with
  ``(seed, content hash of the text's real tokens, layer)`` (as :mod:`mechgeom.analyses.faithfulness.rankings`):
  reproducible for a seed, independent of the batch and of the padding.

Paper A's claim (contribution most faithful) is judged by the area under each effect-vs-rate curve
(:func:`mechgeom.analyses.faithfulness.rankings.area_ordering`, trapezoid, rate 0 included with effect 0):
:meth:`EmbeddingFaithfulness.summary` / :func:`embedding_summary`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._progress import progress
from mechgeom.analyses.base import Result
from mechgeom.analyses.contribution.weights import RANKING_METRICS
from mechgeom.analyses.faithfulness.rankings import (
    FAITHFULNESS_METRICS,
    area_ordering,
    check_sweep_settings,
    claimed_order_verdict,
    layers_label,
    random_scores,
    ranking_readers,
    unit_hash,
)
from mechgeom.analyses.scoring import bootstrap_ci
from mechgeom.hooks import (
    MODES,
    FwdHook,
    expand_kv,
    hook_name,
    is_bidirectional,
    masking_hooks,
    padding_mask,
    rank_sources,
    removal_mask,
    to_tokens,
)
from mechgeom.models.adapter import adapter
from mechgeom.typing import Bool, Float, Int, SourceRanks, Tensor, Tokens, Z

__all__ = [
    "EMBEDDING_RATES",
    "EmbeddingFaithfulness",
    "EmbeddingFn",
    "embedding_curves",
    "embedding_effect",
    "embedding_summary",
]

#: The default removal rates of :func:`embedding_curves`.
EMBEDDING_RATES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9)

#: ``embedding_fn(model, tokens, attention_mask, *, fwd_hooks=()) -> [batch, d_model]``, as
#: :func:`mechgeom.models.encoders.sentence_embedding`.
EmbeddingFn = Callable[..., Float[Tensor, "batch d_model"]]


def embedding_effect(
    masked: Float[Tensor, "batch d_model"], clean: Float[Tensor, "batch d_model"]
) -> Float[Tensor, " batch"]:
    """``1 − cos(masked, clean)`` per text, in float64, clamped to ``[0, 2]`` (NaN for a zero embedding).

    >>> embedding_effect(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([[3.0, 0.0], [1.0, 0.0]])).tolist()
    [0.0, 1.0]
    """
    a, b = masked.double(), clean.double()
    cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return (1.0 - cos).clamp(0.0, 2.0).cpu()


@dataclass
class EmbeddingFaithfulness(Result):
    """The effects of :func:`embedding_curves`: ``effects[metric, mode, rate, text]`` (float64; rate 0 is 0).

    ``unit_hashes[t]`` and ``n_tokens[t]`` name text ``t`` (content hash of its real tokens, their number).
    :meth:`to_frame` gives the tidy curves (or the per-text table), :meth:`summary` judges paper A's order.
    """

    metrics: tuple[str, ...]
    modes: tuple[str, ...]
    rates: tuple[float, ...]
    effects: np.ndarray
    unit_hashes: list[str]
    n_tokens: list[int]
    layers: list[int]
    layers_label: str
    scope: str
    seed: int

    @property
    def n_texts(self) -> int:
        return len(self.unit_hashes)

    def per_text_frame(self) -> pd.DataFrame:
        """One row per (metric, mode, rate, text): ``metric, mode, rate, text, unit_hash, n_tokens, effect``."""
        rows = [
            {
                "metric": m,
                "mode": mode,
                "rate": r,
                "text": t,
                "unit_hash": self.unit_hashes[t],
                "n_tokens": self.n_tokens[t],
                "effect": float(self.effects[i, j, k, t]),
            }
            for i, m in enumerate(self.metrics)
            for j, mode in enumerate(self.modes)
            for k, r in enumerate(self.rates)
            for t in range(self.n_texts)
        ]
        return pd.DataFrame(rows)

    def to_frame(self, *, per_text: bool = False, n_boot: int = 1000) -> pd.DataFrame:
        """The curves, one row per (metric, mode, rate): ``metric, mode, rate, effect`` (mean over texts),
        ``ci_low, ci_high`` (95% bootstrap over texts, ``n_boot`` resamples seeded with ``seed``),
        ``n_texts, layers, scope, seed``. ``per_text=True`` returns :meth:`per_text_frame` instead."""
        if per_text:
            return self.per_text_frame()
        rows = []
        for i, m in enumerate(self.metrics):
            for j, mode in enumerate(self.modes):
                for k, r in enumerate(self.rates):
                    x = self.effects[i, j, k]
                    lo, hi = bootstrap_ci(x, n_boot=n_boot, seed=self.seed) if r > 0 else (0.0, 0.0)
                    rows.append(
                        {
                            "metric": m,
                            "mode": mode,
                            "rate": r,
                            "effect": float(x.mean()),
                            "ci_low": lo,
                            "ci_high": hi,
                        }
                    )
        frame = pd.DataFrame(rows)
        return frame.assign(n_texts=self.n_texts, layers=self.layers_label, scope=self.scope, seed=self.seed)

    def summary(self, *, claimed: Sequence[str] = RANKING_METRICS) -> dict[str, Any]:
        """Per mode, the metrics ordered by area under the effect curve and whether paper A's order holds
        (:func:`embedding_summary` of :meth:`to_frame`)."""
        frame = pd.DataFrame(
            [
                {"metric": m, "mode": mode, "rate": r, "effect": float(self.effects[i, j, k].mean())}
                for i, m in enumerate(self.metrics)
                for j, mode in enumerate(self.modes)
                for k, r in enumerate(self.rates)
            ]
        )
        return embedding_summary(frame, claimed)


def embedding_summary(frame: pd.DataFrame, claimed: Sequence[str] = RANKING_METRICS) -> dict[str, Any]:
    """Paper A's claimed order judged on an effect table (``metric, mode, rate, effect``).

    Per mode, each metric's area under its mean-effect curve (trapezoid over the rates, with the point
    ``(0, 0)`` added where rate 0 is missing: rate 0 removes nothing) orders the metrics
    (:func:`~mechgeom.analyses.faithfulness.rankings.area_ordering`; comprehensiveness: a larger area is more faithful,
    sufficiency: a smaller one). As in :func:`~mechgeom.analyses.faithfulness.rankings.faithfulness_summary`, the
    order ``claimed[0] < claimed[1] < ...`` (least to most faithful) **holds** when every adjacent pair is
    strictly in that order, **holds up to ties** when some pairs have equal areas (identical rankings) and
    none is reversed, and else **does not hold** (also when a claimed metric is missing).

    >>> rows = [{"mode": mo, "metric": m, "rate": r, "effect": v * r}
    ...         for mo, vals in (("comprehensiveness", (1, 2, 2, 4)), ("sufficiency", (4, 3, 2, 1)))
    ...         for m, v in zip(RANKING_METRICS, vals) for r in (0.5, 1.0)]
    >>> out = embedding_summary(pd.DataFrame(rows))
    >>> out["modes"]["comprehensiveness"]["verdict"], out["modes"]["sufficiency"]["ranking"][0]
    ('holds up to ties', ['contribution', 0.5])
    """
    claimed = list(claimed)
    frame = frame[["metric", "mode", "rate", "effect"]]
    zero = [
        {"metric": m, "mode": mo, "rate": 0.0, "effect": 0.0}
        for (mo, m), d in frame.groupby(["mode", "metric"], sort=False)
        if not (d["rate"] == 0).any()
    ]
    if zero:
        frame = pd.concat([frame, pd.DataFrame(zero)], ignore_index=True)
    orders = area_ordering(frame, y="effect", claimed=claimed)
    modes: dict[str, Any] = {}
    for mode in MODES:
        if mode not in set(frame["mode"]):
            continue
        higher = mode == "comprehensiveness"
        area = orders[mode]["area"]
        verdict, ties = claimed_order_verdict(claimed, [area.get(m, np.nan) for m in claimed], higher)
        modes[mode] = {
            "higher_is_more_faithful": higher,
            "area": area,
            "ranking": [[m, area[m]] for m in reversed(orders[mode]["least_to_most_faithful"])],
            "verdict": verdict,
            "ties": ties,
            "random_rank": orders[mode]["random_rank"],
        }
    rates = [float(r) for r in sorted(frame["rate"].unique())]
    return {"claimed": claimed, "rates": rates, "modes": modes}


# --------------------------------------------------------------------------- the sweep


def _check_encoder(model: Any) -> None:
    if not is_bidirectional(model):
        raise TypeError(
            f"{type(model).__name__} is a causal decoder (attention_dir="
            f"{getattr(model.cfg, 'attention_dir', None)!r}); embedding faithfulness is for encoders "
            "(bidirectional attention, a sentence embedding); for a decoder use perplexity_curves (ΔPPL)"
        )


def _check_mask(model: Any, tokens: Tokens, attention_mask: Tensor | None) -> Bool[Tensor, "batch pos"]:
    """The real tokens ``[batch, pos]`` (True = real): ``attention_mask`` (1/0 or bool) or the ``[PAD]`` ids."""
    mask = padding_mask(model, tokens) if attention_mask is None else attention_mask
    if mask is None:
        return torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    if not isinstance(mask, Tensor) or mask.shape != tokens.shape:
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"attention_mask must be a [batch, pos] tensor like tokens {tuple(tokens.shape)}, got {shape}"
        )
    if mask.dtype != torch.bool:
        if mask.dtype.is_floating_point or not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 1 (real token) and 0 (padding) only")
        mask = mask != 0
    empty = (~mask.any(-1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"text(s) {empty} have no real token (attention_mask is 0 everywhere)")
    if not bool(mask.all()):
        adapter(model).check_attention_mask()  # a model that would attend to padding is refused
    return mask.to(tokens.device)


class _ZSideMask:
    """Source masking at ``hook_z`` for a model whose forward discards ``hook_pattern`` edits (TransformerLens
    4's BERT bridge fires ``hook_pattern`` after the HF attention has run; 3.x bridges ignore the edit):
    ``z[i,h] − sum_j alpha[h,i,j] M[h,i,j] v[j,h]``, the same output as ``alpha = 0`` where ``M`` (no
    renormalisation), with ``alpha = softmax(q·k / attn_scale)`` over the real keys recomputed from
    ``hook_q``/``hook_k`` of the same pass and checked against the pattern the model reports (else
    ``RuntimeError``)."""

    def __init__(self, model: Any, layer: int, mask: Tensor, key_mask: Tensor) -> None:
        self.layer, self.mask, self.key_mask = layer, mask, key_mask  # mask [b, rank_head, q, k]
        scale = float(getattr(model.cfg, "attn_scale", -1.0) or -1.0)
        self.scale = scale if scale > 0 else float(model.cfg.d_head) ** 0.5
        self.n_heads = int(model.cfg.n_heads)
        self.acts: dict[str, Tensor] = {}
        self.checked = 0

    def _store(self, x: Tensor, hook: Any, *, kind: str) -> None:
        self.acts[kind] = x.detach()

    def _compare(self) -> None:
        alpha, pattern = self.acts.pop("alpha"), self.acts.pop("pattern")
        if not torch.allclose(alpha, pattern.to(alpha.dtype), atol=1e-4, rtol=0):
            raise RuntimeError(
                f"masking at blocks.{self.layer}.attn.hook_z: the pattern recomputed from hook_q/hook_k differs "
                f"from hook_pattern by {float((alpha - pattern).abs().max()):.2e}; this attention is not "
                "softmax(q·k / attn_scale) over the real keys"
            )
        self.checked += 1

    def _pattern(self, pattern: Tensor, hook: Any) -> None:
        self.acts["pattern"] = pattern.detach()
        if "alpha" in self.acts:
            self._compare()

    def _edit_z(self, z: Z, hook: Any) -> Z:
        q, k = self.acts.pop("q"), expand_kv(self.acts.pop("k"), self.n_heads)
        v = expand_kv(self.acts.pop("v"), self.n_heads)
        scores = torch.einsum("bihd,bjhd->bhij", q, k) / self.scale
        alpha = scores.masked_fill(~self.key_mask[:, None, None, :], -torch.inf).softmax(-1)
        self.acts["alpha"] = alpha
        if "pattern" in self.acts:
            self._compare()
        removed = torch.einsum("bhij,bjhd->bihd", alpha * self.mask, v)
        return z - removed.to(z.dtype)

    @property
    def hooks(self) -> list[FwdHook]:
        la = self.layer
        stores = [(hook_name(la, kind), partial(self._store, kind=kind)) for kind in ("q", "k", "v")]
        return [*stores, (hook_name(la, "pattern"), self._pattern), (hook_name(la, "z"), self._edit_z)]


def _masking_path(model: Any, tokens: Tokens, layer: int) -> str:
    """``"pattern"`` when a zeroed ``hook_pattern`` reaches the model's output, else ``"z"`` when
    :class:`_ZSideMask` does (each tried on ``tokens``, one text of real tokens, by the backend's adapter:
    removing every source must leave ``hook_attn_out = b_O``); neither raises ``RuntimeError``."""
    backend = adapter(model)
    if backend.pattern_edits_take_effect(layer, tokens=tokens):
        return "pattern"
    real = torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device)
    zside = _ZSideMask(model, layer, real[:, None, None, :] & real[:, None, :, None], real)
    if backend.edits_reach_output(layer, zside.hooks, tokens=tokens):
        return "z"
    raise backend.ignored_edits_error(layer, ("hook_pattern", "hook_z"), "source masking")


def _masked_hooks(
    model: Any, path: str, ranks: dict[int, SourceRanks], rate: float, mode: str, batch: _Batch
) -> tuple[list[FwdHook], list[_ZSideMask]]:
    """The removal hooks of one masked pass: on ``hook_pattern`` (:func:`masking_hooks`) or at ``hook_z``."""
    if path == "pattern":
        return masking_hooks(
            model, ranking=_Ranking(ranks), rate=rate, mode=mode, n_sources=batch.n_sources
        ), []
    zs = [
        _ZSideMask(model, la, removal_mask(r, rate, mode, batch.n_sources), batch.mask)
        for la, r in ranks.items()
    ]
    return [h for z in zs for h in z.hooks], zs


@dataclass
class _Batch:
    tokens: Tokens
    mask: Bool[Tensor, "batch pos"]
    n_sources: Int[Tensor, "batch pos"]
    clean: Float[Tensor, "batch d_model"]
    rankings: dict[str, dict[int, SourceRanks]]
    alias: dict[str, str]


def _random_ranks(mask: Tensor, hashes: list[str], n_heads: int, *, seed: int, layer: int) -> SourceRanks:
    """The random control's ranks: noise over each text's real tokens (``random_scores``), padding last."""
    b, pos = mask.shape
    scores = torch.zeros(b, n_heads, pos, pos)
    for t in range(b):
        real = mask[t].nonzero().flatten().cpu()
        n = len(real)
        noise = random_scores(n_heads, n, n, seed=seed, unit_hash=hashes[t], layer=layer)
        scores[t][:, real[:, None], real[None, :]] = noise
    return rank_sources(scores.to(mask.device), causal=False, key_mask=mask)


def _clean_batch(
    model: Any,
    tokens: Tokens,
    mask: Bool[Tensor, "batch pos"],
    hashes: list[str],
    *,
    metrics: tuple[str, ...],
    layers: list[int],
    scope: str,
    seed: int,
    embedding_fn: EmbeddingFn,
    extra_hooks: Sequence[FwdHook],
) -> _Batch:
    """One clean pass: the clean embedding and every metric's ranks at ``layers`` (``extra_hooks`` first)."""
    ranks, readers = ranking_readers(
        model, layers, metrics, scope, lambda s: rank_sources(s, causal=False, key_mask=mask.to(s.device))
    )
    hooks: list[FwdHook] = [*extra_hooks, *readers]
    with torch.no_grad():
        clean = embedding_fn(model, tokens, mask.long(), fwd_hooks=hooks)
    if "random" in metrics:
        n_heads = int(model.cfg.n_heads) if scope == "intra" else 1
        for layer in layers:
            ranks["random"][layer] = _random_ranks(mask, hashes, n_heads, seed=seed, layer=layer)
    alias: dict[str, str] = {}  # metrics whose rankings coincide share their masked passes
    for m in metrics:
        alias[m] = next(
            (a for a in alias.values() if all(torch.equal(ranks[a][la], ranks[m][la]) for la in layers)), m
        )
    n_sources = mask.long().sum(-1, keepdim=True) * mask.long()  # [b q]: real keys of a real query, else 0
    return _Batch(tokens, mask, n_sources, clean, ranks, alias)


def embedding_curves(
    model: Any,
    tokens_or_text: Tensor | str | Sequence[str],
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    rates: Sequence[float] = EMBEDDING_RATES,
    modes: Sequence[str] = MODES,
    layers: int | Sequence[int] | None = None,
    scope: str = "intra",
    attention_mask: Tensor | None = None,
    batch_size: int = 8,
    seed: int = 0,
    embedding_fn: EmbeddingFn | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    verbose: bool = False,
) -> EmbeddingFaithfulness:
    """Paper A's comprehensiveness and sufficiency curves on an encoder: ``1 − cos(e_masked, e_clean)`` of
    the sentence embedding when each metric's top or bottom ``ceil(rate * n)`` of the ``n`` real sources
    of every real query are removed at ``layers`` (default: all at once); see the module docstring.

    ``tokens_or_text``: texts (the model's tokenizer: ``[CLS] text [SEP]``, right-padded with ``[PAD]``) or
    ids ``[n_texts, pos]``; ``attention_mask`` (``[n_texts, pos]``, 1 = real token; default: the ``[PAD]``
    ids, or none) marks padding. One clean pass per batch of ``batch_size`` texts (the clean embedding and
    every ranking, streamed layer by layer), then one masked pass per (metric, mode, rate > 0); metrics
    whose rankings coincide on a batch share their passes. ``embedding_fn(model, tokens, attention_mask,
    *, fwd_hooks)`` gives the embeddings (default :func:`mechgeom.models.encoders.sentence_embedding`);
    ``extra_hooks`` are attached first in every pass (the curves of the modified model). ``verbose`` shows
    a progress bar over the passes.

    Raises ``TypeError`` for a decoder (use :func:`~mechgeom.analyses.faithfulness.perplexity_curves`) and
    ``ValueError``/``IndexError`` for a rate outside ``[0, 1]``, an unknown metric, mode or scope, a bad
    layer, mask or batch size. A model whose forward discards ``hook_pattern`` edits (a bridge; one probe
    pass finds out) is masked at ``hook_z`` instead (module docstring); ``extra_hooks`` on ``hook_z`` of a
    masked layer are then refused (``ValueError``), and a model that discards both edits raises
    ``RuntimeError``. No hook stays attached.
    """
    _check_encoder(model)
    metrics_t, rates_t, modes_t, chosen, scope = check_sweep_settings(
        model, metrics, rates, modes, layers, scope, batch_size
    )
    tokens = to_tokens(model, tokens_or_text, what="embedding faithfulness", encoders=True)
    mask = _check_mask(model, tokens, attention_mask)
    if embedding_fn is None:
        from mechgeom.models.encoders import sentence_embedding

        embedding_fn = sentence_embedding
    path = _masking_path(model, tokens[:1][:, mask[0]], chosen[0])
    clash = sorted({name for name, _ in extra_hooks} & {hook_name(la, "z") for la in chosen})
    if path == "z" and clash:
        raise ValueError(
            f"{type(model).__name__} discards hook_pattern edits, so sources are removed at hook_z, where "
            f"extra_hooks also edit {clash}; give extra_hooks elsewhere (e.g. hook_v) or mask other layers"
        )
    n = tokens.shape[0]
    hashes = [unit_hash(tokens[t][mask[t]]) for t in range(n)]
    effects = np.zeros((len(metrics_t), len(modes_t), len(rates_t), n), dtype=np.float64)
    keys = [
        (i, j, k)
        for i in range(len(metrics_t))
        for j in range(len(modes_t))
        for k, r in enumerate(rates_t)
        if r > 0
    ]
    starts = list(range(0, n, int(batch_size)))
    tasks = [(s, key) for s in starts for key in (None, *keys)]
    batch: _Batch | None = None
    shared: dict[tuple[str, str, float], Tensor] = {}
    for s, key in progress(tasks, desc="embedding faithfulness", enabled=verbose, total=len(tasks)):
        sl = slice(s, min(s + int(batch_size), n))
        if key is None:
            m = mask[sl]
            pos = int(m.any(0).nonzero().max()) + 1  # drop the columns that are padding in every text
            batch = _clean_batch(
                model,
                tokens[sl, :pos],
                m[:, :pos],
                hashes[sl],
                metrics=metrics_t,
                layers=chosen,
                scope=scope,
                seed=seed,
                embedding_fn=embedding_fn,
                extra_hooks=extra_hooks,
            )
            shared = {}
            continue
        assert batch is not None
        i, j, k = key
        metric, mode, rate = batch.alias[metrics_t[i]], modes_t[j], rates_t[k]
        if (metric, mode, rate) not in shared:
            masking, zside = _masked_hooks(model, path, batch.rankings[metric], rate, mode, batch)
            with torch.no_grad():
                masked = embedding_fn(
                    model, batch.tokens, batch.mask.long(), fwd_hooks=[*extra_hooks, *masking]
                )
            if any(z.checked == 0 for z in zside):
                raise RuntimeError(
                    "masking at hook_z: hook_pattern never fired, so the pattern was not checked"
                )
            shared[(metric, mode, rate)] = embedding_effect(masked, batch.clean)
        effects[i, j, k, sl] = shared[(metric, mode, rate)].numpy()
    return EmbeddingFaithfulness(
        metrics=metrics_t,
        modes=modes_t,
        rates=rates_t,
        effects=effects,
        unit_hashes=hashes,
        n_tokens=[int(x) for x in mask.sum(-1).tolist()],
        layers=chosen,
        layers_label=layers_label(model, chosen),
        scope=scope,
        seed=seed,
    )


@dataclass
class _Ranking:
    """What :func:`mechgeom.hooks.masking_hooks` reads of a ranking: ``ranks[layer]`` and ``layers``."""

    ranks: dict[int, SourceRanks]

    @property
    def layers(self) -> list[int]:
        return list(self.ranks)
