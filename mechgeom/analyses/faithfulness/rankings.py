"""Rankings for paper A's faithfulness test (``docs/definitions.md`` §3.2): of the sources of each query, from a clean pass,
and of the metrics, from the curves of :mod:`mechgeom.analyses.faithfulness.curves`.

**Source rankings.** The sources of each query are ranked by a *ranking method*; the masking hooks
(:func:`mechgeom.hooks.masking_hooks`) then remove the top- or bottom-ranked sources. Conventions fixed here
(keyword arguments keep the defaults):

- **Clean ranking, no re-ranking.** Rankings are computed once per batch, from a clean forward pass (no
  hooks of ours; a sweep's ``extra_hooks`` are attached); the masked pass applies that ranking at every
  chosen layer and never re-ranks, even though the masked pass's own activations at later layers differ.
- **Ranking.** A method gives a score per (query, source); per query ``i`` of a decoder only sources
  ``j <= i`` are ranked (``j > i`` are never counted and never removed), on an encoder every real key.
  Sources are sorted by the **signed** score, largest first (rank 0 = top), with a stable sort, so ties go
  to the **lower position first**. A NaN score (a zero output norm, see
  :mod:`mechgeom.analyses.contribution.weights`) ranks **below every finite value**; inside a fully NaN
  row the order is by position (:func:`mechgeom.hooks.rank_sources`).
- **Scope.** ``scope="intra"`` ranks per head; ``scope="inter"`` once per layer, applied to every head.
- **Per-query normalisation does not change a ranking.** ``value_weighted_normalized`` is
  ``value_weighted`` divided by one positive number per query, so both rank the sources of a query
  identically (up to ties made by rounding); sweeps detect identical rankings and run their masked
  passes once.
- **Storage.** Ranks are stored as the per-query rank of each source in the smallest integer dtype
  (uint8 up to 256 positions); the hook builds the boolean mask on the fly from ``(rank, rate, mode)``.

**The registry of ranking methods.** Every source ranking is a method registered under a name;
:func:`perplexity_curves`, :func:`task_accuracy_curves`, :func:`embedding_curves` and
:func:`source_rankings` accept any registered name in ``metrics`` (:func:`ranking_methods` lists them).
Built in:

- the contribution metrics of :mod:`mechgeom.analyses.contribution.weights` (``attention``,
  ``value_weighted``, ``value_weighted_normalized``, ``contribution`` in both scopes; ``head_share``,
  ``factor_norm_ratio``, ``factor_cos`` per head only), read by one
  :class:`~mechgeom.analyses.contribution.weights.ContributionCollector` on the clean pass;
- ``random``: uniform noise over each text's real tokens, drawn from a generator seeded with
  ``(seed, content hash of the text's real tokens, layer)``: reproducible for a seed, independent of the
  batch and of padding.
- ``rollout``: attention rollout (:mod:`mechgeom.analyses.attribution.rollout`), a layer-level score that
  ranks every head's sources the same way, in both scopes.

A new method is one function registered with :func:`register_ranking`::

    @register_ranking("my_scores", scopes=("inter",))
    def my_scores(request: RankingRequest, names: tuple[str, ...]) -> list[FwdHook]:
        def read(pattern, hook):                      # [batch, head_index, query_pos, key_pos]
            layer = int(hook.name.split(".")[1])
            request.emit("my_scores", layer, pattern.mean(1, keepdim=True))   # [batch, 1, q, k]
        return [(hook_name(la, "pattern"), read) for la in request.layers]

The function gets a :class:`RankingRequest` (the model, the batch's tokens and real-token mask, the layers,
scope and seed, the ``extra_hooks`` of the sweep) and the names asked of it, and must call
``request.emit(name, layer, scores)`` once per name and layer with scores ``[batch, head_index or 1,
query_pos, key_pos]`` (larger = ranked first; ``[batch, 1, q, k]`` is one ranking for every head). It
returns the hooks to attach to the clean pass (readers that emit as the pass runs), or emits at once and
returns ``[]`` (a method that needs no pass, like ``random``, or runs passes of its own, as gradient- or
value-zeroing methods would; those passes should carry ``request.extra_hooks``). Methods registered with the
same function are asked together (one collector serves every contribution metric). A method that emits
nothing for a layer is an error naming it.

A sweep's rankings depend on the model (with its ``extra_hooks``), the layers, the scope and the seed:
:func:`sweep_settings` gives the settings, and the sweep store adds the model's weights, dtype and hooks
(:mod:`mechgeom.sweep.fingerprint`).

**Metric rankings.** :func:`faithfulness_summary` ranks the metrics by mean ΔPPL and judges paper A's
claimed order; :func:`area_ordering` orders them by the area under a curve.

>>> rate_key(0.1 + 0.2), unit_hash(torch.tensor([1, 2, 3]))[:1]
(0.3, 'u')
>>> ranking_methods("inter")
('attention', 'value_weighted', 'value_weighted_normalized', 'contribution', 'random', 'rollout')
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from mechgeom._deprecation import keyword_only
from mechgeom.analyses.attribution.rollout import RolloutCollector
from mechgeom.analyses.base import Result
from mechgeom.analyses.contribution.weights import (
    INTER_METRICS,
    INTRA_METRICS,
    RANKING_METRICS,
    ContributionCollector,
)
from mechgeom.hooks import (
    MODES,
    FwdHook,
    check_indices,
    check_mode,
    check_rate,
    decoder_source_counts,
    rank_sources,
    removal_mask,
    resolve_layers,
    run_hooks,
    to_batch,
)
from mechgeom.sweep import model_label
from mechgeom.typing import Bool, Float, SourceRanks, Tensor, Tokens

__all__ = [
    "DEFAULT_RATES",
    "FAITHFULNESS_METRICS",
    "SCOPES",
    "RankingMethod",
    "RankingPass",
    "RankingRequest",
    "RankingScorer",
    "SourceRanking",
    "SweepSettings",
    "area_ordering",
    "faithfulness_summary",
    "random_scores",
    "ranking_method",
    "ranking_methods",
    "register_ranking",
    "source_rankings",
    "sweep_settings",
    "unit_hash",
]

#: Intra-head metrics rank per head; inter-head metrics rank once per layer and apply to all heads.
SCOPES = ("intra", "inter")
#: The metrics compared by default: paper A's four, in its claimed order, and the random control.
FAITHFULNESS_METRICS = (*RANKING_METRICS, "random")
#: The removal rates ``0, 0.1, ..., 0.9`` (``docs/definitions.md`` §3.3), the default of every faithfulness sweep.
DEFAULT_RATES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


# --------------------------------------------------------------------------- validation


def _check_rates(rates: Sequence[float]) -> tuple[float, ...]:
    if isinstance(rates, (int, float)):
        rates = (rates,)
    out = tuple(dict.fromkeys(rate_key(check_rate(r)) for r in rates))
    if not out:
        raise ValueError("rates is empty; give at least one rate in [0, 1]")
    return out


def _check_modes(modes: Sequence[str]) -> tuple[str, ...]:
    if isinstance(modes, str):
        modes = (modes,)
    out = tuple(dict.fromkeys(check_mode(m) for m in modes))
    if not out:
        raise ValueError(f"modes is empty; choose from {list(MODES)}")
    return out


def _check_scope(scope: str) -> str:
    if scope not in SCOPES:
        raise ValueError(
            f"unknown scope {scope!r}; choose 'intra' (rank per head) or 'inter' (rank per layer)"
        )
    return scope


def _check_metrics(metrics: Sequence[str], scope: str) -> tuple[str, ...]:
    if isinstance(metrics, str):
        metrics = (metrics,)
    allowed = ranking_methods(scope)
    unknown = [m for m in metrics if m not in allowed]
    if unknown:
        raise ValueError(f"unknown {scope}-head ranking metric(s) {unknown}; choose from {list(allowed)}")
    out = tuple(dict.fromkeys(metrics))
    if not out:
        raise ValueError(f"metrics is empty; choose from {list(allowed)}")
    return out


def rate_key(rate: float) -> float:
    """Rates are compared and stored rounded to 10 decimals (so CSV round trips match)."""
    return round(float(rate), 10)


class SweepSettings(NamedTuple):
    """A masking sweep's settings, checked (:func:`check_sweep_settings`)."""

    metrics: tuple[str, ...]
    rates: tuple[float, ...]
    modes: tuple[str, ...]
    layers: list[int]
    scope: str


def check_sweep_settings(
    model: Any,
    metrics: Sequence[str],
    rates: Sequence[float],
    modes: Sequence[str],
    layers: int | Sequence[int] | None,
    scope: str,
    batch_size: int,
) -> SweepSettings:
    """The settings of a sweep, checked: metrics, rates and modes deduplicated in order, the layers.

    A decoder sweep checks the model with :func:`~mechgeom.hooks.check_decoder` first; the encoder curves
    take the same settings.
    """
    scope = _check_scope(scope)
    metrics_t = _check_metrics(metrics, scope)
    rates_t = _check_rates(rates)
    modes_t = _check_modes(modes)
    chosen = resolve_layers(model, layers)
    if int(batch_size) < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    return SweepSettings(metrics_t, rates_t, modes_t, chosen, scope)


# --------------------------------------------------------------------------- the ranking


@dataclass
class SourceRanking(Result):
    """Per-query rankings of the sources at each layer, computed from a clean pass.

    ``ranks[layer]`` is ``[batch, head_index, q, k]`` (``scope="intra"``) or ``[batch, 1, q, k]``
    (``scope="inter"``, one ranking applied to every head): the rank of source ``j`` among the sources
    ``j' <= i`` of query ``i`` (0 = top-ranked). The masked pass uses these clean ranks; it never re-ranks.
    In a padded batch, pads rank after every real source and ``n_sources`` counts the real ones.
    """

    metric: str
    scope: str
    ranks: dict[int, SourceRanks]
    seed: int | None = None
    unit_hashes: list[str] = field(default_factory=list)
    #: ``[batch, query_pos]`` sources of each query where the batch was padded (0 at a pad), else None;
    #: :func:`~mechgeom.hooks.masking_hooks` counts removals with it, so a pad is never removed.
    n_sources: Tensor | None = None

    @property
    def layers(self) -> list[int]:
        return list(self.ranks)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.ranks.values())

    def mask(self, layer: int, rate: float, mode: str) -> Bool[Tensor, "batch rank_head query_pos key_pos"]:
        """The boolean removal mask of ``layer`` (True = removed) at ``rate`` and ``mode``."""
        if layer not in self.ranks:
            raise IndexError(f"layer {layer} was not ranked; ranked layers are {self.layers}")
        return removal_mask(self.ranks[layer], rate, mode)

    def same_as(self, other: SourceRanking) -> bool:
        """Whether two rankings would remove exactly the same sources at every rate and mode."""
        return self.ranks.keys() == other.ranks.keys() and all(
            torch.equal(self.ranks[la], other.ranks[la]) for la in self.ranks
        )

    def summary(self) -> dict[str, Any]:
        """``metric``, ``scope``, ``seed``, the ranked ``layers``, ``n_texts`` and the ranks' ``nbytes``."""
        first = next(iter(self.ranks.values()), None)
        return {
            "metric": self.metric,
            "scope": self.scope,
            "seed": self.seed,
            "layers": self.layers,
            "n_texts": 0 if first is None else int(first.shape[0]),
            "nbytes": self.nbytes,
        }

    def to_frame(self, *, batch: int | None = None, layer: int | None = None) -> pd.DataFrame:
        """Tidy table: ``batch, layer, head, query, key, rank`` for ``key <= query`` (head -1 = whole layer).

        ``batch`` (default: every text) and ``layer`` are checked: out of range raises ``IndexError`` naming
        the valid range. A padded batch's table has only real sources of real queries (positions in the
        padded batch); pads are not ranked among them."""
        frames = []
        sel = self.layers if layer is None else [layer]
        for la in sel:
            if la not in self.ranks:
                raise IndexError(f"layer {la} was not ranked; ranked layers are {self.layers}")
        for la in sel:
            for b in check_indices(batch, self.ranks[la].shape[0], "batch"):
                r = self.ranks[la][b]  # [rank_head, q, k]
                qq, kk = torch.tril_indices(r.shape[-2], r.shape[-1])
                if self.n_sources is not None:  # a real source of a real query ranks below its count
                    n = self.n_sources[b].cpu()[qq]  # [pairs]
                    real = (r.cpu()[:, qq, kk].long() < n).all(0)
                    qq, kk = qq[real], kk[real]
                for h in range(r.shape[0]):
                    frames.append(
                        pd.DataFrame(
                            {
                                "batch": b,
                                "layer": la,
                                "head": h if self.scope == "intra" else -1,
                                "query": qq.numpy(),
                                "key": kk.numpy(),
                                "rank": r[h, qq, kk].long().cpu().numpy(),
                            }
                        )
                    )
        return pd.concat(frames, ignore_index=True)


# --------------------------------------------------------------------------- the registry of ranking methods


def unit_hash(tokens: Tensor, n_context: int = 0) -> str:
    """Content hash of one sequence (its tokens and where scoring starts)."""
    h = hashlib.sha1(np.asarray(tokens.detach().cpu(), dtype=np.int64).tobytes())
    h.update(str(n_context).encode())
    return "u" + h.hexdigest()[:16]  # the prefix keeps CSV readers from parsing it as a number


@dataclass(frozen=True)
class RankingRequest:
    """What a ranking method is given for one batch of texts (see the module docstring).

    ``tokens`` are ``[batch, pos]`` ids, right-padded, on the model's device; ``key_mask`` marks the real
    tokens (a decoder's are a prefix of each row; an encoder's padding is False); ``text_hashes`` are the
    content hashes of each text's real tokens (:func:`unit_hash`), which seed anything random. ``causal``
    is False on an encoder (every real key is a source of every real query). ``emit(name, layer, scores)``
    takes ``[batch, head_index or 1, query_pos, key_pos]`` scores, larger = ranked first.
    """

    model: Any
    tokens: Tokens
    key_mask: Bool[Tensor, "batch pos"]
    layers: list[int]
    scope: str
    seed: int
    causal: bool
    text_hashes: list[str]
    extra_hooks: tuple[FwdHook, ...]
    emit: Callable[[str, int, Tensor], None]

    @property
    def n_heads(self) -> int:
        """Rankings per layer: the model's heads for ``scope="intra"``, 1 for ``"inter"``."""
        return int(self.model.cfg.n_heads) if self.scope == "intra" else 1


#: ``scorer(request, names) -> hooks``: scores of the methods ``names`` for one batch, emitted through
#: ``request.emit`` (by hooks on the clean pass, or at once); see the module docstring.
RankingScorer = Callable[[RankingRequest, tuple[str, ...]], Sequence[FwdHook]]


@dataclass(frozen=True)
class RankingMethod:
    """A registered source ranking: its name, the function that scores it and the scopes it supports."""

    name: str
    scorer: RankingScorer
    scopes: tuple[str, ...] = SCOPES
    description: str = ""


_METHODS: dict[str, RankingMethod] = {}


def register_ranking(
    name: str,
    scorer: RankingScorer | None = None,
    *,
    scopes: Sequence[str] = SCOPES,
    description: str = "",
    replace: bool = False,
) -> Any:
    """Register the ranking method ``name``, scored by ``scorer`` (directly or as a decorator).

    Args:
        name: what ``metrics=`` calls it (not ``"clean"``, which names a sweep's clean pass).
        scorer: ``scorer(request, names) -> hooks`` (see the module docstring); methods registered with the
            same function are scored together on one clean pass.
        scopes: the scopes it ranks in, a subset of :data:`SCOPES`.
        description: one line for :func:`ranking_methods` listings and error messages.
        replace: allow replacing a registered method (else ``ValueError``).

    Returns:
        ``scorer`` (so the decorator form leaves the function as it is).
    """
    if scorer is None:
        return partial(register_ranking, name, scopes=scopes, description=description, replace=replace)
    if not isinstance(name, str) or not name or name == "clean":
        raise ValueError(f"a ranking method needs a non-empty name other than 'clean', got {name!r}")
    if not callable(scorer):
        raise TypeError(f"the scorer of {name!r} must be callable, got {type(scorer).__name__}")
    bad = [s for s in scopes if s not in SCOPES]
    if bad or not scopes:
        raise ValueError(
            f"scopes of {name!r} must be a non-empty subset of {list(SCOPES)}, got {list(scopes)}"
        )
    if name in _METHODS and not replace:
        raise ValueError(f"a ranking method {name!r} is registered already; pass replace=True to replace it")
    _METHODS[name] = RankingMethod(name, scorer, tuple(scopes), description)
    return scorer


def ranking_methods(scope: str | None = None) -> tuple[str, ...]:
    """The registered ranking methods (those ranking in ``scope`` when given), in registration order."""
    return tuple(m.name for m in _METHODS.values() if scope is None or scope in m.scopes)


def ranking_method(name: str) -> RankingMethod:
    """The registered method ``name``; ``ValueError`` lists the registered names."""
    try:
        return _METHODS[name]
    except KeyError:
        raise ValueError(f"unknown ranking method {name!r}; registered: {list(ranking_methods())}") from None


def contribution_scores(request: RankingRequest, names: tuple[str, ...]) -> list[FwdHook]:
    """The contribution metrics ``names`` of every layer, from one :class:`ContributionCollector` on the
    clean pass (intra: ``[batch, head, q, k]``; inter: ``[batch, 1, q, k]``, one ranking for every head)."""
    scope = request.scope

    def on_layer(layer: int, out: dict[str, dict[str, Tensor]]) -> None:
        for m, scores in out[scope].items():  # intra: [batch, head, q, k]; inter: [batch, q, k]
            request.emit(m, layer, scores if scope == "intra" else scores[:, None])

    intra, inter = (list(names), []) if scope == "intra" else ([], list(names))
    col = ContributionCollector(request.model, request.layers, intra=intra, inter=inter, on_layer=on_layer)
    return col.fwd_hooks


def random_scores(
    n_heads: int, length: int, pad_to: int, *, seed: int, unit_hash: str, layer: int
) -> Float[Tensor, "head query_pos key_pos"]:
    """Uniform noise for the random control, seeded by ``(seed, unit content hash, layer)``."""
    state = np.random.SeedSequence([int(seed), int(unit_hash[1:16], 16), int(layer)]).generate_state(2)
    g = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
    out = torch.zeros(n_heads, pad_to, pad_to)
    out[:, :length, :length] = torch.rand(n_heads, length, length, generator=g)
    return out


def random_control(request: RankingRequest, names: tuple[str, ...]) -> list[FwdHook]:
    """The random control: per text, :func:`random_scores` over its real tokens (0 at padding); no pass."""
    b, pos = request.tokens.shape
    for layer in request.layers:
        scores = torch.zeros(b, request.n_heads, pos, pos)
        for t in range(b):
            real = request.key_mask[t].nonzero().flatten().cpu()
            n = len(real)
            noise = random_scores(
                request.n_heads, n, n, seed=request.seed, unit_hash=request.text_hashes[t], layer=layer
            )
            scores[t][:, real[:, None], real[None, :]] = noise
        for name in names:
            request.emit(name, layer, scores)
    return []


for _name in INTRA_METRICS:
    register_ranking(
        _name,
        contribution_scores,
        scopes=SCOPES if _name in INTER_METRICS else ("intra",),
        description=f"the contribution metric {_name!r} (mechgeom.analyses.contribution.weights)",
    )
register_ranking("random", random_control, description="uniform noise seeded by (seed, text, layer)")


def rollout_scores(request: RankingRequest, names: tuple[str, ...]) -> list[FwdHook]:
    """Attention rollout (:mod:`mechgeom.analyses.attribution.rollout`): a layer-level score, the same
    ranking for every head (``[batch, 1, q, k]`` inter-head, repeated over heads intra-head)."""

    def on_scores(layer: int, scores: Tensor) -> None:
        per_head = scores[:, None].expand(-1, request.n_heads, -1, -1)
        for name in names:
            request.emit(name, layer, per_head)

    return RolloutCollector(request.model, request.layers, on_scores=on_scores).fwd_hooks


register_ranking(
    "rollout", rollout_scores, description="attention rollout (Abnar and Zuidema 2020), layer-level"
)


# --------------------------------------------------------------------------- rankings of one batch


class RankingPass:
    """Every requested method's rankings of one batch of texts: :attr:`hooks` go on the batch's clean pass
    (after the sweep's ``extra_hooks``), then :meth:`rankings` returns one :class:`SourceRanking` per name.

    Args:
        model: the model the clean pass runs.
        tokens: ``[batch, pos]`` ids, right-padded.
        key_mask: ``[batch, pos]`` real tokens (default: every position).
        names: registered method names (checked by :func:`check_sweep_settings`).
        layers, scope, seed: what to rank, per head or per layer, and the random control's seed.
        causal: False on an encoder (every real key is a source; padded keys rank last).
        extra_hooks: the sweep's interventions (methods that run passes of their own attach them).
        store_device: where the ranks are kept (the model's device in a sweep).
    """

    def __init__(
        self,
        model: Any,
        tokens: Tokens,
        names: Sequence[str],
        *,
        layers: list[int],
        scope: str,
        seed: int,
        key_mask: Bool[Tensor, "batch pos"] | None = None,
        causal: bool = True,
        extra_hooks: Sequence[FwdHook] = (),
        store_device: str | torch.device = "cpu",
    ) -> None:
        mask = (
            torch.ones(tokens.shape, dtype=torch.bool, device=tokens.device) if key_mask is None else key_mask
        )
        self.layers, self.scope, self.seed, self.causal = list(layers), scope, seed, causal
        self.key_mask, self.store_device = mask, store_device
        #: the real-token mask where the batch has padding, else None (the plain decoder ranking)
        self.padding = None if bool(mask.all()) else mask.bool()
        self.shape = (
            int(tokens.shape[0]),
            int(model.cfg.n_heads) if scope == "intra" else 1,
            int(tokens.shape[1]),
        )
        # the random control is seeded by each text's content (its real tokens), not by its batch slot
        self.text_hashes = [unit_hash(tokens[t][mask[t]]) for t in range(tokens.shape[0])]
        self.ranks: dict[str, dict[int, Tensor]] = {m: {} for m in names}
        request = RankingRequest(
            model,
            tokens,
            mask,
            self.layers,
            scope,
            seed,
            causal,
            self.text_hashes,
            tuple(extra_hooks),
            self.emit,
        )
        groups: dict[Any, list[str]] = {}
        for m in names:
            groups.setdefault(ranking_method(m).scorer, []).append(m)
        self.hooks: list[FwdHook] = []
        for scorer, group in groups.items():
            self.hooks += list(scorer(request, tuple(group)))

    def emit(self, name: str, layer: int, scores: Tensor) -> None:
        """Rank ``scores`` ``[batch, head_index or 1, q, k]`` of method ``name`` at ``layer`` and keep the ranks."""
        if name not in self.ranks or layer not in self.layers:
            raise ValueError(
                f"a ranking method emitted {name!r} at layer {layer}; asked for {list(self.ranks)} at {self.layers}"
            )
        b, heads, pos = self.shape
        if (
            scores.ndim != 4
            or scores.shape[0] != b
            or scores.shape[1] not in (1, heads)
            or scores.shape[2:] != (pos, pos)
        ):
            raise ValueError(
                f"ranking method {name!r} emitted scores of shape {tuple(scores.shape)} at layer {layer}; need "
                f"[batch={b}, head_index={heads} or 1, query_pos={pos}, key_pos={pos}]"
            )
        if self.causal:  # a padded batch: pads rank after the real sources, as in the text alone
            ranks = rank_sources(scores, key_mask=self.padding)
        else:
            ranks = rank_sources(scores, causal=False, key_mask=self.key_mask.to(scores.device))
        self.ranks[name][layer] = ranks.to(self.store_device)

    @property
    def n_sources(self) -> Tensor | None:
        """The sources of each ``[batch, query]`` where the batch has padding (0 at a pad; a decoder's real
        keys ``j <= i``, an encoder's real keys), else None (a decoder's ``i + 1``, an encoder's every key)."""
        if self.padding is None:
            return None
        if self.causal:
            return decoder_source_counts(self.padding).to(self.store_device)
        m = self.padding.long()
        return (m.sum(-1, keepdim=True) * m).to(self.store_device)

    def rankings(self) -> dict[str, SourceRanking]:
        """One :class:`SourceRanking` per name, once the clean pass has run.

        Raises:
            RuntimeError: a method emitted no scores for some layer.
        """
        for m, by_layer in self.ranks.items():
            missing = [la for la in self.layers if la not in by_layer]
            if missing:
                raise RuntimeError(f"ranking method {m!r} gave no scores for layer(s) {missing}")
        return {
            m: SourceRanking(
                metric=m,
                scope=self.scope,
                ranks={la: by_layer[la] for la in self.layers},
                seed=self.seed if m == "random" else None,
                unit_hashes=list(self.text_hashes),
                n_sources=self.n_sources,
            )
            for m, by_layer in self.ranks.items()
        }


@keyword_only("metrics")
def source_rankings(
    model: Any,
    tokens_or_text: str | Sequence[str] | Tensor,
    *,
    metrics: Sequence[str] = FAITHFULNESS_METRICS,
    scope: str = "intra",
    layers: int | Sequence[int] | None = None,
    seed: int = 0,
    extra_hooks: Sequence[FwdHook] = (),
    attention_mask: Tensor | None = None,
) -> dict[str, SourceRanking]:
    """Rankings of every method of ``metrics`` at ``layers`` (default: all) from one clean forward pass.

    ``attention_mask`` (``[batch, pos]``, 1 at real tokens; default: derived for a list of texts,
    :func:`~mechgeom.hooks.to_batch`, left or right padding as the tokenizer's ``padding_side``) runs the
    pass with the padding masked; pads then rank after every real source and the rankings carry
    ``n_sources``, so :func:`~mechgeom.hooks.masking_hooks` never removes a pad.

    Intra-head metrics (``scope="intra"``, the default) give one ranking per head; inter-head metrics
    (``scope="inter"``) one per layer, applied to every head. ``"random"`` draws uniform noise seeded by
    ``(seed, text content, layer)``. Ties: lower position first; NaN ranks last (see the module docs).
    ``extra_hooks`` run in the same pass, before the metric readers (the ranking of a modified model).
    ``metrics`` may name any registered method (:func:`ranking_methods`).
    """
    scope = _check_scope(scope)
    metrics = _check_metrics(metrics, scope)
    tokens, mask = to_batch(model, tokens_or_text, attention_mask=attention_mask, what="source rankings")
    chosen = resolve_layers(model, layers)
    ranked = RankingPass(
        model, tokens, metrics, layers=chosen, scope=scope, seed=seed, extra_hooks=extra_hooks,
        store_device=tokens.device, key_mask=mask,
    )  # fmt: skip
    run_hooks(model, tokens, [*extra_hooks, *ranked.hooks], attention_mask=mask)
    return ranked.rankings()


# --------------------------------------------------------------------------- what a ranking depends on


def layers_label(model: Any, layers: list[int]) -> str:
    return "all" if layers == list(range(int(model.cfg.n_layers))) else ",".join(map(str, layers))


def sweep_settings(
    model: Any, layers: list[int], scope: str, seed: int, *, outcome: Any = None
) -> dict[str, Any]:
    """What a resumed sweep must match besides what the sweep store fingerprints itself (the model's weights
    and dtype, the code and data of ``extra_hooks``: ``docs/sweeps.md``): the model's name, the layers, the
    ranking scope and the seed, and ``outcome`` (an encoder sweep's embedding function), which a checkpointed
    store fingerprints by its code and data (:func:`mechgeom.sweep.describe`; a store without a path takes
    none)."""
    settings: dict[str, Any] = {
        "model": model_label(model),
        "layers": layers_label(model, layers),
        "scope": scope,
        "seed": seed,
    }
    if outcome is not None:
        settings["outcome"] = outcome
    return settings


# --------------------------------------------------------------------------- ranking the metrics


def faithfulness_summary(frame: pd.DataFrame, claimed: Sequence[str] = RANKING_METRICS) -> dict[str, Any]:
    """Paper A's claimed order judged on a ΔPPL table of :func:`perplexity_curves`.

    Per mode, each metric's mean ΔPPL over the rates > 0 ranks the metrics, most faithful first
    (comprehensiveness: higher is more faithful; sufficiency: lower). The claimed order
    ``claimed[0] < claimed[1] < ...`` (least to most faithful) **holds** when every adjacent pair of
    ``claimed`` is strictly in that order, **holds up to ties** when some pairs have equal means (identical
    rankings, e.g. intra-head value-weighted and output-normalised) and none is reversed, and else **does
    not hold** (a claimed metric missing from the table has a NaN mean, so the order does not hold).
    ``ties`` lists the adjacent claimed pairs with equal means. Modes absent from the table are left out.

    >>> rows = [{"mode": mo, "metric": m, "rate": r, "delta_ppl": v * r}
    ...         for mo, vals in (("comprehensiveness", (1, 2, 2, 4)), ("sufficiency", (4, 3, 2, 1)))
    ...         for m, v in zip(RANKING_METRICS, vals) for r in (0.0, 0.5, 1.0)]
    >>> out = faithfulness_summary(pd.DataFrame(rows))
    >>> out["modes"]["comprehensiveness"]["verdict"], out["modes"]["comprehensiveness"]["ties"]
    ('holds up to ties', [['value_weighted', 'value_weighted_normalized']])
    >>> out["modes"]["sufficiency"]["verdict"], out["modes"]["sufficiency"]["ranking"][0]
    ('holds', ['contribution', 0.75])
    """
    claimed = list(claimed)
    area = frame[frame["rate"] > 0].groupby(["mode", "metric"])["delta_ppl"].mean()
    modes: dict[str, Any] = {}
    for mode, higher in (("comprehensiveness", True), ("sufficiency", False)):
        if mode not in area.index.get_level_values(0):
            continue
        by_metric = area[mode]
        ranked = by_metric.sort_values(ascending=not higher)
        verdict, ties = claimed_order_verdict(
            claimed, [float(by_metric.get(m, np.nan)) for m in claimed], higher
        )
        modes[mode] = {
            "higher_is_more_faithful": higher,
            "ranking": [[str(m), float(v)] for m, v in ranked.items()],
            "verdict": verdict,
            "ties": ties,
        }
    clean = float(frame["clean_ppl"].iloc[0]) if "clean_ppl" in frame.columns and len(frame) else None
    rates = [float(r) for r in sorted(frame["rate"].unique())]
    return {"claimed": claimed, "clean_ppl": clean, "rates": rates, "modes": modes}


def claimed_order_verdict(
    claimed: Sequence[str], values: Sequence[float], higher: bool
) -> tuple[str, list[list[str]]]:
    """Whether ``values`` (one per metric of ``claimed``, least to most faithful) come in the claimed order:
    ``"holds"`` (each step more faithful: larger if ``higher``, else smaller), ``"holds up to ties"`` (some
    steps equal, e.g. identical rankings) or ``"does not hold"`` (a NaN never holds); and the tied pairs.

    >>> claimed_order_verdict(["a", "b", "c"], [1.0, 2.0, 2.0], higher=True)
    ('holds up to ties', [['b', 'c']])
    """
    better = [(b - a) if higher else (a - b) for a, b in itertools.pairwise(values)]  # > 0: claimed order
    ties = [[x, y] for (x, y), d in zip(itertools.pairwise(claimed), better, strict=True) if d == 0]
    if all(d > 0 for d in better):
        return "holds", ties
    if all(d >= 0 for d in better):
        return "holds up to ties", ties
    return "does not hold", ties


def area_ordering(
    frame: pd.DataFrame, y: str = "delta_ppl", claimed: Sequence[str] = RANKING_METRICS
) -> dict[str, Any]:
    """Per mode: each metric's area under ``y`` vs rate (trapezoid) and the metrics from least to most
    faithful (comprehensiveness: a larger area is more faithful; sufficiency: a smaller one), whether the
    ``claimed`` metrics present come in that order, and the random control's place (``None`` if absent).

    >>> rows = [{"mode": mo, "metric": m, "rate": r, "delta_ppl": v * r} for mo in MODES
    ...         for m, v in (("attention", 1.0), ("contribution", 3.0)) for r in (0.0, 1.0)]
    >>> out = area_ordering(pd.DataFrame(rows))
    >>> out["comprehensiveness"]["area"], out["sufficiency"]["least_to_most_faithful"]
    ({'attention': 0.5, 'contribution': 1.5}, ['contribution', 'attention'])
    """
    out: dict[str, Any] = {}
    for mode in MODES:
        sub = frame[frame["mode"] == mode]
        area = {}
        for metric, d in sub.groupby("metric", sort=False):
            d = d.sort_values("rate")
            x, v = d["rate"].to_numpy(float), d[y].to_numpy(float)
            area[str(metric)] = float(np.sum((x[1:] - x[:-1]) * (v[1:] + v[:-1]) / 2))
        sign = 1 if mode == "comprehensiveness" else -1
        least_to_most = sorted(area, key=lambda m: sign * area[m])
        ranks = [least_to_most.index(m) for m in claimed if m in area]
        out[mode] = {
            "area": area,
            "least_to_most_faithful": least_to_most,
            "agrees_with_paper_order": ranks == sorted(ranks),
            "random_rank": least_to_most.index("random") if "random" in area else None,
        }
    return out
