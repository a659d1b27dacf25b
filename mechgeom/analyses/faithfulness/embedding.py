"""Faithfulness without a language-model head: paper A's source masking on an encoder (``docs/definitions.md`` §3.6).

A decoder's faithfulness is ΔPPL of next-token prediction (:mod:`mechgeom.analyses.faithfulness.curves`); an
encoder (BERT-style, bidirectional attention, e.g. ``"minilm-l6"``) predicts no next token. Its outcome is
the **sentence embedding** ``e``: the final hidden states mean-pooled over the real (non-padding) tokens
(sentence-transformers' pooling, :func:`mechgeom.encoder_models.sentence_embedding`). Definition:

- **Effect.** "``effect = 1 − cos(e_masked, e_clean)`` per text (0 = no change)", in ``[0, 2]`` (clamped
  there against rounding; NaN where an embedding is the zero vector). A curve is the mean effect over
  texts at each removal rate, with a 95% percentile bootstrap over texts
  (:func:`mechgeom.analyses.scoring.bootstrap_ci`).
- **Removal.** As for decoders: "removing source ``j`` from query ``i`` = setting ``alpha[h,i,j] = 0``
  **without renormalising**, as a hook on ``hook_pattern``", at every chosen layer at once
  (:func:`mechgeom.hooks.masking_hooks`); the ranking comes from one clean pass and is never re-ranked.
  Where the model discards ``hook_pattern`` edits (TransformerLens 4's BERT bridge fires the hook after
  HF's attention has run; 3.x bridges ignore the edit; one probe pass per call finds out), the same removal
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
  them, so a text in a padded batch has the effect it has alone. A left-padded batch (the tokenizer's
  ``padding_side="left"``, or such a mask) is right-aligned first: an encoder's positions are absolute,
  so a text must start at position 0 to be read as alone.
- **Random control.** ``"random"`` ranks by uniform noise over the real tokens, seeded with
  ``(seed, content hash of the text's real tokens, layer)`` (as :mod:`mechgeom.analyses.faithfulness.rankings`):
  reproducible for a seed, independent of the batch and of the padding.

Paper A's claim (contribution most faithful) is judged by the area under each effect-vs-rate curve
(:func:`mechgeom.analyses.faithfulness.rankings.area_ordering`, trapezoid, rate 0 included with effect 0):
:meth:`EmbeddingFaithfulness.summary` / :func:`embedding_summary`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import keyword_only
from mechgeom._io import write_frame
from mechgeom.analyses.base import Result
from mechgeom.analyses.contribution.weights import RANKING_METRICS
from mechgeom.analyses.faithfulness.harness import (
    Masker,
    UnitBatch,
    Units,
    check_checkpoint,
    masking_sweep,
    pattern_masking,
    record_path,
    unit_values,
)
from mechgeom.analyses.faithfulness.rankings import (
    DEFAULT_RATES,
    FAITHFULNESS_METRICS,
    SourceRanking,
    area_ordering,
    check_sweep_settings,
    claimed_order_verdict,
    layers_label,
    sweep_settings,
    unit_hash,
)
from mechgeom.analyses.scoring import bootstrap_ci, right_align
from mechgeom.hooks import (
    MODES,
    FwdHook,
    expand_kv,
    hook_name,
    is_bidirectional,
    padding_mask,
    removal_mask,
    to_tokens,
)
from mechgeom.models.adapter import adapter
from mechgeom.sweep import Executor
from mechgeom.typing import Bool, Float, Tensor, Tokens, Z

__all__ = [
    "EMBEDDING_RATES",
    "EmbeddingChange",
    "EmbeddingFaithfulness",
    "EmbeddingFn",
    "embedding_curves",
    "embedding_effect",
    "embedding_summary",
    "z_masking",
]

#: The default removal rates of :func:`embedding_curves`: those of every faithfulness sweep, ``0, 0.1, ..., 0.9``.
EMBEDDING_RATES = DEFAULT_RATES

#: ``embedding_fn(model, tokens, attention_mask, *, fwd_hooks=()) -> [batch, d_model]``, as
#: :func:`mechgeom.encoder_models.sentence_embedding`.
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
    n_boot: int = 1000

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

    def to_frame(self, *, per_text: bool = False, n_boot: int | None = None) -> pd.DataFrame:
        """The curves, one row per (metric, mode, rate): ``metric, mode, rate, effect`` (mean over texts),
        ``ci_low, ci_high`` (95% bootstrap over texts, ``n_boot`` resamples (default: the sweep's) seeded
        with ``seed``), ``n_texts, layers, scope, seed``. ``per_text=True`` returns :meth:`per_text_frame`."""
        if per_text:
            return self.per_text_frame()
        n_boot = self.n_boot if n_boot is None else n_boot
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
    ``z[i,h] − sum_j alpha[h,i,j] M[h,i,j] (v[j,h] − b_V[h])``, the same output as ``alpha = 0`` where ``M``
    (no renormalisation, the value bias kept whole as in :func:`~mechgeom.hooks.masking_hooks`), with ``alpha = softmax(q·k / attn_scale)`` over the real keys recomputed from
    ``hook_q``/``hook_k`` of the same pass and checked against the pattern the model reports (else
    ``RuntimeError``)."""

    def __init__(self, model: Any, layer: int, mask: Tensor, key_mask: Tensor) -> None:
        self.layer, self.mask, self.key_mask = layer, mask, key_mask  # mask [b, rank_head, q, k]
        scale = float(getattr(model.cfg, "attn_scale", -1.0) or -1.0)
        self.scale = scale if scale > 0 else float(model.cfg.d_head) ** 0.5
        self.n_heads = int(model.cfg.n_heads)
        self.b_V = adapter(model).value_bias(layer)  # removed sources take v - b_V away (§1.3)
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
        if self.b_V is not None:
            v = v - self.b_V.to(v.device, v.dtype)
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


def z_masking(
    model: Any, ranking: SourceRanking, rate: float, mode: str, batch: UnitBatch
) -> tuple[list[FwdHook], Callable[[], None]]:
    """Removal at ``hook_z`` (:class:`_ZSideMask`, for a model that discards ``hook_pattern`` edits), and
    the check that every layer's recomputed pattern was compared with ``hook_pattern``."""
    zs = [
        _ZSideMask(model, la, removal_mask(r, rate, mode, batch.n_sources), batch.mask)
        for la, r in ranking.ranks.items()
    ]

    def check() -> None:
        if any(z.checked == 0 for z in zs):
            raise RuntimeError("masking at hook_z: hook_pattern never fired, so the pattern was not checked")

    return [h for z in zs for h in z.hooks], check


@dataclass(frozen=True)
class EmbeddingChange:
    """The encoders' outcome: the sentence embedding of each text (``embedding_fn``, gradient-free), recorded
    as ``effect = 1 − cos(masked, clean)`` (0 for the clean pass) with the text's real tokens ``n_tokens``."""

    embedding_fn: EmbeddingFn

    def measure(self, model: Any, batch: UnitBatch, hooks: Sequence[FwdHook]) -> Tensor:
        with torch.no_grad():
            return self.embedding_fn(model, batch.tokens, batch.mask.long(), fwd_hooks=list(hooks))

    def clean_columns(self, batch: UnitBatch, clean: Tensor) -> dict[str, Any]:
        return {"effect": np.zeros(len(batch.idx)), "n_tokens": batch.mask.sum(-1).cpu().numpy()}

    def masked_columns(self, batch: UnitBatch, masked: Tensor, clean: Tensor) -> dict[str, Any]:
        effect = embedding_effect(masked, clean).numpy()
        return {"effect": effect, "n_tokens": batch.mask.sum(-1).cpu().numpy()}


def _encoder_units(
    model: Any, tokens_or_text: Tensor | str | Sequence[str], attention_mask: Tensor | None
) -> Units:
    """The texts as units: ids and real-token mask on the CPU, named by the hash of their real tokens; a
    left-padded batch (``padding_side="left"``, or such a mask) is right-aligned (:func:`~mechgeom.analyses.scoring.right_align`: BERT's positions are absolute)."""
    tokens = to_tokens(model, tokens_or_text, what="embedding faithfulness", encoders=True)
    mask = _check_mask(model, tokens, attention_mask)
    tokens, mask = right_align(tokens, mask)
    hashes = [unit_hash(tokens[t][mask[t]]) for t in range(tokens.shape[0])]
    return Units(tokens=tokens.cpu(), mask=mask.cpu(), hashes=hashes)


def _masker(model: Any, units: Units, layers: list[int], extra_hooks: Sequence[FwdHook]) -> Masker:
    """:func:`~mechgeom.analyses.faithfulness.harness.pattern_masking`, or :func:`z_masking` where the model
    discards ``hook_pattern`` edits (one probe pass on the first text); ``extra_hooks`` may not edit the
    ``hook_z`` that the latter edits."""
    first = units.tokens[:1][:, units.mask[0]].to(model.cfg.device)
    if _masking_path(model, first, layers[0]) == "pattern":
        return pattern_masking
    clash = sorted({name for name, _ in extra_hooks} & {hook_name(la, "z") for la in layers})
    if clash:
        raise ValueError(
            f"{adapter(model).name} discards hook_pattern edits, so sources are removed at hook_z, where "
            f"extra_hooks also edit {clash}; give extra_hooks elsewhere (e.g. hook_v) or mask other layers"
        )
    return z_masking


@keyword_only("metrics", "rates", "modes")
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
    n_boot: int = 1000,
    embedding_fn: EmbeddingFn | None = None,
    checkpoint: str | Path | None = None,
    extra_hooks: Sequence[FwdHook] = (),
    executor: Executor | None = None,
    verbose: bool = False,
) -> EmbeddingFaithfulness:
    """Paper A's comprehensiveness and sufficiency curves on an encoder: ``1 − cos(e_masked, e_clean)`` of
    the sentence embedding when each metric's top or bottom ``ceil(rate * n)`` of the ``n`` real sources
    of every real query are removed at ``layers`` (default: all at once); see the module docstring.

    A specialisation of the masking harness (:mod:`mechgeom.analyses.faithfulness.harness`), like
    :func:`~mechgeom.analyses.faithfulness.perplexity_curves`: one clean pass per batch of ``batch_size``
    texts (the clean embedding and every ranking, streamed layer by layer), then one masked pass per
    (metric, mode, rate > 0) on the sweep engine; metrics whose rankings coincide on a batch share their
    passes. ``metrics`` may name any registered ranking method.

    Args:
        model: an encoder (``HookedEncoder`` or a bidirectional bridge).
        tokens_or_text: texts (the model's tokenizer: ``[CLS] text [SEP]``, right-padded with ``[PAD]``) or
            ids ``[n_texts, pos]``.
        metrics, rates, modes, layers, scope, seed: as for ``perplexity_curves``.
        attention_mask: ``[n_texts, pos]``, 1 = real token (default: the ``[PAD]`` ids, or none).
        batch_size: texts per clean pass.
        n_boot: bootstrap resamples of the table's intervals (:meth:`EmbeddingFaithfulness.to_frame`).
        embedding_fn: ``embedding_fn(model, tokens, attention_mask, *, fwd_hooks)`` gives the embeddings
            (default :func:`mechgeom.encoder_models.sentence_embedding`); picklable for an executor.
        checkpoint: ``.csv``/``.parquet``: the table is written there and the per-text record to
            ``<stem>.per_text<suffix>`` after every pass; a rerun with the same settings (model, layers,
            scope, seed, ``embedding_fn`` and ``extra_hooks`` by a stable repr) resumes from it, other
            settings raise ``ValueError``.
        extra_hooks: attached first in every pass (the curves of the modified model).
        executor: where the items run (e.g. :class:`mechgeom.sweep.RayExecutor`); the result is the same.
        verbose: a progress bar over the passes.

    Returns:
        An :class:`EmbeddingFaithfulness` (``effects[metric, mode, rate, text]``).

    Raises:
        TypeError: a decoder (use :func:`~mechgeom.analyses.faithfulness.perplexity_curves`).
        ValueError, IndexError: a rate outside ``[0, 1]``, an unknown metric, mode or scope, a bad layer,
            mask or batch size; ``extra_hooks`` on ``hook_z`` of a masked layer of a model masked there.
        RuntimeError: a model that discards both ``hook_pattern`` and ``hook_z`` edits (one probe pass finds
            out which one reaches the output; a bridge is masked at ``hook_z``, module docstring).
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 49 lines.
    _check_encoder(model)
    checked = check_sweep_settings(model, metrics, rates, modes, layers, scope, batch_size)
    metrics_t, rates_t, modes_t, chosen, scope = checked
    units = _encoder_units(model, tokens_or_text, attention_mask)
    if embedding_fn is None:
        from mechgeom.encoder_models import sentence_embedding

        embedding_fn = sentence_embedding
    masker = _masker(model, units, chosen, extra_hooks)
    path = check_checkpoint(checkpoint)
    record = masking_sweep(
        model,
        units,
        EmbeddingChange(embedding_fn),
        checked,
        seed=seed,
        batch_size=int(batch_size),
        settings=sweep_settings(model, chosen, scope, seed, outcome=embedding_fn),
        record=None if path is None else record_path(path, "per_text"),
        extra_hooks=extra_hooks,
        executor=executor,
        causal=False,
        masker=masker,
        what="embedding faithfulness record",
        desc="embedding faithfulness",
        verbose=verbose,
    )
    effects = np.zeros((len(metrics_t), len(modes_t), len(rates_t), len(units.hashes)), dtype=np.float64)
    for (i, m), (j, mode), (k, r) in itertools.product(
        enumerate(metrics_t), enumerate(modes_t), enumerate(rates_t)
    ):
        if r > 0:
            effects[i, j, k] = unit_values(record, (m, mode, r), units.hashes, "effect")
    result = EmbeddingFaithfulness(
        metrics=metrics_t,
        modes=modes_t,
        rates=rates_t,
        effects=effects,
        unit_hashes=units.hashes,
        n_tokens=units.lengths,
        layers=chosen,
        layers_label=layers_label(model, chosen),
        scope=scope,
        seed=seed,
        n_boot=n_boot,
    )
    if path is not None:
        write_frame(result.to_frame(), path)
    return result
