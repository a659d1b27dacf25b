"""Every intervention factory: ``(hook_name, fn)`` pairs that change ``hook_pattern``, ``hook_v`` or ``hook_z``.

One naming scheme: ``*_hooks(model, ...)`` builds the pairs for chosen layers and heads, and each pair's
``fn`` is a ``*_hook(tensor, hook, **settings) -> tensor`` closure (shapes commented). They mix with
``transformer_lens.patching`` hooks and mechgeom's readers in one ``run_with_hooks`` call; put them before
the readers. ``docs/definitions.md`` defines each intervention (§3.1, §4.5, §4.6, §7.1):

- source masking (paper A's faithfulness): :func:`masking_hooks` / :func:`mask_sources_hook` /
  :func:`ranked_mask_hook`, with the ranking maths (:func:`rank_sources`, :func:`n_removed`,
  :func:`removal_interval`, :func:`removal_mask`);
- sink mass (the convexity curve): :func:`sink_mass_hooks` / :func:`set_sink_mass_hook`;
- sink value (sink-norm ablation): :func:`sink_value_hooks` / :func:`ablate_value_hook`;
- head removal (pruning): :func:`head_ablation_hooks` / :func:`replace_z_hook`.

Each factory asks the backend's adapter whether an edit at its hook point reaches the output
(:meth:`~mechgeom.models.adapter.ModelAdapter.check_edits`, one probe per layer and hook point) and raises a
``RuntimeError`` naming the backend and the hook point where it would not: no intervention does nothing
silently. Where the model keeps a value bias ``b_V`` in ``hook_v`` (``docs/definitions.md`` §1.3), the
interventions act on ``v - b_V`` and ``z - b_V`` and keep ``b_V W_O`` with ``b_O``, so they do the same on a
model loaded with or without its value biases folded.

>>> removal_interval(0.5, "comprehensiveness", 4)[1].tolist()
[1, 1, 2, 2]
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any, Literal

import numpy as np
import torch
from transformer_lens.hook_points import HookPoint

from mechgeom.hooks.masks import masked_mean, resolve_sinks, sink_mask
from mechgeom.hooks.readers import FwdHook, current_pass_mask, hook_name
from mechgeom.hooks.validation import resolve_heads, resolve_layers, text_positions
from mechgeom.maths import rank_dtype, stable_ranks
from mechgeom.models.adapter import adapter
from mechgeom.typing import Bool, Float, Int, Pattern, SourceRanks, Tensor, Z

__all__ = [
    "MODES",
    "VALUE_ABLATION_MODES",
    "Head",
    "HeadAblationMode",
    "ValueAblationMode",
    "ablate_value_hook",
    "affected_heads",
    "check_mode",
    "check_rate",
    "decoder_source_counts",
    "head_ablation_hooks",
    "kv_groups",
    "mask_sources_hook",
    "masking_hooks",
    "n_kv_heads",
    "n_removed",
    "rank_sources",
    "ranked_mask_hook",
    "removal_interval",
    "removal_mask",
    "replace_z_hook",
    "resolve_head_set",
    "set_sink_mass_hook",
    "sink_mass_hooks",
    "sink_value_hooks",
    "value_bias_keepers",
]


# --------------------------------------------------------------------------- source masking (hook_pattern)


#: The two interventions of paper A.
MODES = ("comprehensiveness", "sufficiency")


def check_rate(rate: float) -> float:
    r = float(rate)
    if not (0.0 <= r <= 1.0):  # also rejects NaN
        raise ValueError(f"removal rate must be in [0, 1], got {rate!r}")
    return r


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {list(MODES)}")
    return mode


def _source_counts(n_queries: int, n_sources: Tensor | None) -> Int[Tensor, "*batch query_pos"]:
    """The number of sources of each query: a decoder's ``i+1``, or the given per-(text, query) counts."""
    if n_sources is None:
        return torch.arange(1, n_queries + 1)
    dtype = getattr(n_sources, "dtype", type(n_sources))
    if not isinstance(n_sources, Tensor) or n_sources.dtype.is_floating_point or dtype == torch.bool:
        raise TypeError(f"n_sources must be an integer tensor, got {dtype}")
    if n_sources.ndim not in (1, 2) or n_sources.shape[-1] != n_queries:
        shape = tuple(n_sources.shape)
        raise ValueError(
            f"n_sources must be [query_pos] or [batch, query_pos] ({n_queries} queries), got {shape}"
        )
    if n_sources.numel() and int(n_sources.min()) < 0:
        raise ValueError(f"n_sources must be >= 0, got {int(n_sources.min())}")
    return n_sources.long()


def n_removed(
    rate: float, n_queries: int, n_sources: Int[Tensor, "*batch query_pos"] | None = None
) -> Int[Tensor, "*batch query_pos"]:
    """Number of sources removed at each query (``docs/definitions.md`` §3.3): at removal rate ``r``, ``ceil(r * (i+1))``
    sources per query.

    ``r * (i+1)`` is rounded to 9 decimals before the ceiling, so ``0.3 * 10`` counts 3. ``n_sources``
    (``[query_pos]`` or ``[batch, query_pos]``, e.g. an encoder's number of real keys, 0 at a padded query)
    replaces the decoder's ``i+1``: ``ceil(r * n_sources)``.

    >>> n_removed(0.5, 4).tolist()
    [1, 1, 2, 2]
    >>> n_removed(0.3, 10)[-1].item()
    3
    >>> n_removed(0.5, 3, torch.tensor([[3, 3, 0]])).tolist()
    [[2, 2, 0]]
    """
    r = check_rate(rate)
    size = _source_counts(n_queries, n_sources)
    count = size.cpu().numpy().astype(np.float64)
    return torch.from_numpy(np.ceil(np.round(r * count, 9)).astype(np.int64)).to(size.device)


def removal_interval(
    rate: float, mode: str, n_queries: int, n_sources: Int[Tensor, "*batch query_pos"] | None = None
) -> tuple[Int[Tensor, "*batch query_pos"], Int[Tensor, "*batch query_pos"]]:
    """The ranks ``[lo_i, hi_i)`` removed at each query ``i`` (rank 0 = top; query ``i`` ranks ``i+1`` sources,
    or ``n_sources[..., i]`` when given, see :func:`n_removed`).

    - comprehensiveness (remove the top-ranked): ``[0, n_i)``
    - sufficiency (remove the bottom-ranked): ``[i+1-n_i, i+1)`` (``[s_i - n_i, s_i)`` for ``s = n_sources``)

    >>> [t.tolist() for t in removal_interval(0.5, "sufficiency", 4)]
    [[0, 1, 1, 2], [1, 2, 3, 4]]
    >>> [t.tolist() for t in removal_interval(0.5, "sufficiency", 3, torch.tensor([[3, 3, 0]]))]
    [[[1, 1, 0]], [[3, 3, 0]]]
    """
    check_mode(mode)
    n = n_removed(rate, n_queries, n_sources)
    size = _source_counts(n_queries, n_sources).to(n.device)
    if mode == "comprehensiveness":
        return torch.zeros_like(n), n
    return size - n, size


def rank_sources(
    scores: Float[Tensor, "*batch query_pos key_pos"],
    *,
    causal: bool = True,
    key_mask: Bool[Tensor, "*batch key_pos"] | None = None,
) -> Int[Tensor, "*batch query_pos key_pos"]:
    """The rank of each source within its query's ranking (0 = largest score), in a small integer dtype.

    Only sources ``j <= i`` compete (``j > i`` get ranks ``i+1, i+2, ...``, never removed). Descending,
    **stable** sort on the signed score: ties go to the lower position first; NaN ranks below every finite
    value (NaN rows are ordered by position).

    ``causal=False`` (an encoder): every key competes for every query, except the padded keys where
    ``key_mask`` (``[key_pos]`` or ``[batch, key_pos]``, True = real token) is False: they rank after every
    real key (NaN included), by position, and are never removed when the removal counts are the numbers of
    real keys (``n_sources`` of :func:`removal_mask`).

    ``causal=True`` with ``key_mask`` (a padded decoder batch, left or right padding): the sources of query
    ``i`` are its real keys ``j <= i``; padded keys rank after them (NaN included), then the keys after the
    query, each group by position. With ``n_sources`` = each query's position inside its own text + 1 (0 at
    a padded query, :func:`decoder_source_counts`) a removal never touches a pad, and the real sources get
    the ranks they get when the text runs alone.

    >>> rank_sources(torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.5, 0.0], [0.3, 0.3, 0.4]])).tolist()
    [[0, 1, 2], [1, 0, 2], [1, 2, 0]]
    >>> rank_sources(torch.tensor([[0.0, 0.5, 9.0], [0.2, float("nan"), 0.1]]), causal=False,
    ...              key_mask=torch.tensor([True, True, False])).tolist()
    [[1, 0, 2], [0, 1, 2]]
    >>> rank_sources(torch.tensor([[[9.0, 0.0, 0.0], [9.0, 0.2, 0.0], [9.0, 0.3, 0.4]]]),
    ...              key_mask=torch.tensor([[False, True, True]])).tolist()
    [[[0, 1, 2], [1, 0, 2], [2, 1, 0]]]
    """
    if not causal:
        return _rank_all_keys(scores, key_mask)
    q, k = scores.shape[-2:]
    if q > k:
        raise ValueError(f"scores have more queries ({q}) than keys ({k})")
    future = torch.ones(q, k, dtype=torch.bool, device=scores.device).triu(diagonal=1 + k - q)
    s = torch.where(torch.isnan(scores) | future, torch.full_like(scores, -math.inf), scores)
    if key_mask is None:
        return stable_ranks(s, descending=True, dtype=rank_dtype(k))
    pad = ~_key_mask_like(scores, key_mask)  # [*batch, 1, k]
    # real past keys first (by score, NaN last), then padded keys, then future keys, each by position
    late = future.long() * 2 * k + pad.long() * k
    rank = stable_ranks(s, descending=True, dtype=torch.long) + late
    return stable_ranks(rank, descending=False, dtype=rank_dtype(k))


def _key_mask_like(scores: Tensor, key_mask: Tensor) -> Tensor:
    """``key_mask`` (``[key_pos]`` or ``[batch, key_pos]`` bools) shaped to broadcast against ``scores``
    ``[*batch, q, k]``: ``[k]`` or ``[batch, 1, ..., k]``."""
    k = scores.shape[-1]
    if key_mask.dtype != torch.bool or key_mask.ndim not in (1, 2) or key_mask.shape[-1] != k:
        raise ValueError(
            f"key_mask must be a boolean [key_pos] or [batch, key_pos] tensor with {k} keys, "
            f"got {key_mask.dtype} of shape {tuple(key_mask.shape)}"
        )
    if key_mask.ndim == 2:
        if scores.ndim < 3 or key_mask.shape[0] != scores.shape[0]:
            raise ValueError(f"key_mask {tuple(key_mask.shape)} does not fit scores {tuple(scores.shape)}")
        key_mask = key_mask.view(key_mask.shape[0], *[1] * (scores.ndim - 2), k)
    return key_mask.to(scores.device)


def decoder_source_counts(key_mask: Bool[Tensor, "batch pos"]) -> Int[Tensor, "batch pos"]:
    """The number of sources of each query of a padded decoder batch: its position inside its own text + 1,
    0 at a padded query (``n_sources`` of :func:`removal_mask` and :func:`masking_hooks`).

    >>> decoder_source_counts(torch.tensor([[False, True, True], [True, True, False]])).tolist()
    [[0, 1, 2], [1, 2, 0]]
    """
    m = key_mask.bool()
    return torch.where(m, m.long().cumsum(-1), torch.zeros_like(m, dtype=torch.long))


def _rank_all_keys(scores: Tensor, key_mask: Tensor | None) -> Tensor:
    """:func:`rank_sources` of an encoder: every key competes; padded keys (``~key_mask``) rank last."""
    k = scores.shape[-1]
    s = torch.where(torch.isnan(scores), torch.full_like(scores, -math.inf), scores)
    if key_mask is None:
        return stable_ranks(s, descending=True, dtype=rank_dtype(k))
    pad = (~_key_mask_like(scores, key_mask)).long() * k  # padded keys: after every real key, in rank order
    rank = stable_ranks(s, descending=True, dtype=torch.long) + pad
    return stable_ranks(rank, descending=False, dtype=rank_dtype(k))


def _bounds(rate: float, mode: str, ranks: Tensor, n_sources: Tensor | None) -> tuple[Tensor, Tensor]:
    """``lo, hi`` of :func:`removal_interval`, shaped to broadcast against ``ranks`` ``[batch, rank_head, q, k]``:
    ``[q, 1]``, or ``[batch, 1, q, 1]`` for per-text ``n_sources`` ``[batch, q]``."""
    lo, hi = removal_interval(rate, mode, ranks.shape[-2], n_sources)
    lo, hi = lo.to(ranks.device)[..., None], hi.to(ranks.device)[..., None]
    if lo.ndim == 3:
        if lo.shape[0] != ranks.shape[0]:
            raise ValueError(f"n_sources has {lo.shape[0]} texts, the ranks {ranks.shape[0]}")
        lo, hi = lo[:, None], hi[:, None]
    return lo, hi


def removal_mask(
    ranks: SourceRanks, rate: float, mode: str, n_sources: Int[Tensor, "*batch query_pos"] | None = None
) -> Bool[Tensor, "batch rank_head query_pos key_pos"]:
    """``True`` where a source is removed: ranks in :func:`removal_interval` of its query (never ``j > i``;
    with ``n_sources``, e.g. an encoder's real keys per ``[batch, query]``, never a rank ``>= n_sources``).

    >>> r = rank_sources(torch.tensor([[[[1.0, 0.0], [0.2, 0.5]]]]))
    >>> removal_mask(r, 0.5, "comprehensiveness")[0, 0].tolist()
    [[True, False], [False, True]]
    """
    return _interval_mask(ranks, *_bounds(rate, mode, ranks, n_sources))


def _interval_mask(ranks: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    # ranks [batch rank_head q k]; lo, hi [q, 1]
    mask = ranks < hi
    if bool((lo > 0).any()):
        mask &= ranks >= lo
    return mask


def _check_pattern_match(pattern: Tensor, other: Tensor, hook: HookPoint | None, what: str) -> None:
    b, h, q, k = pattern.shape
    ob, oh, oq, ok = other.shape
    if ob != b or oq != q or ok != k or oh not in (1, h):
        raise ValueError(
            f"{what} of shape {tuple(other.shape)} does not fit the pattern {tuple(pattern.shape)} "
            f"at {getattr(hook, 'name', 'hook_pattern')} (need [batch, head_index or 1, query_pos, key_pos])"
        )


def mask_sources_hook(
    pattern: Pattern, hook: HookPoint, *, mask: Bool[Tensor, "batch head_or_1 query_pos key_pos"]
) -> Pattern:
    """``hook_pattern`` hook: ``alpha[h,i,j] = 0`` where ``mask`` is True, **no renormalisation**.

    ``mask`` is ``[batch, head_index, q, k]`` or ``[batch, 1, q, k]`` (broadcast to heads).
    """
    # pattern: [batch, head_index, query_pos, key_pos]
    _check_pattern_match(pattern, mask, hook, "mask")
    return pattern.masked_fill(mask, 0.0)


def ranked_mask_hook(
    pattern: Pattern,
    hook: HookPoint,
    *,
    ranks: SourceRanks,
    lo: Int[Tensor, "*batch query_pos 1"],
    hi: Int[Tensor, "*batch query_pos 1"],
) -> Pattern:
    """``hook_pattern`` hook: remove the sources whose clean rank lies in ``[lo_i, hi_i)``, no renormalisation.

    ``lo``/``hi`` are ``[q, 1]`` (shared) or ``[batch, 1, q, 1]`` (per text, an encoder's counts).

    The mask is built on the fly from the stored ranks (``[batch, head_index or 1, q, k]``); the ranks
    come from the clean pass and are not recomputed here.
    """
    # pattern: [batch, head_index, query_pos, key_pos]; ranks: [batch, head_index | 1, query_pos, key_pos]
    _check_pattern_match(pattern, ranks, hook, "ranks")
    return pattern.masked_fill(_interval_mask(ranks, lo, hi), 0.0)


def masking_hooks(
    model: Any,
    *,
    mask: Tensor | dict[int, Tensor] | None = None,
    ranking: Any = None,
    rate: float | None = None,
    mode: str = "comprehensiveness",
    layers: int | Sequence[int] | None = None,
    n_sources: Int[Tensor, "*batch query_pos"] | None = None,
) -> list[FwdHook]:
    """``(hook_name, fn)`` pairs on ``blocks.{l}.attn.hook_pattern`` that remove (query, source) pairs.

    Give either

    - ``mask``: a boolean ``[batch, head_index, q, k]`` or ``[batch, q, k]`` (broadcast to heads) tensor,
      True = remove, applied at every layer of ``layers`` (default: all); or a ``{layer: mask}`` dict; or
    - ``ranking`` (a :class:`SourceRanking` from :func:`source_rankings`), ``rate`` in ``[0, 1]`` and
      ``mode`` (``"comprehensiveness"`` removes the top ``ceil(rate * (i+1))`` sources of query ``i``,
      ``"sufficiency"`` the bottom ones) at ``layers`` (default: every ranked layer). The clean ranking is
      applied as is; the masked pass does not re-rank.

    With a ranking, ``n_sources`` (``[batch, q]``) replaces the decoder's ``i+1`` sources of query ``i``:
    an encoder ranks every real key (:func:`rank_sources` with ``causal=False``), so its counts are the
    numbers of real keys (0 at a padded query); a padded decoder batch counts each query's real sources
    (:func:`decoder_source_counts`). Without ``n_sources``, the ranking's own ``n_sources`` is used when it
    has one (a :class:`SourceRanking` of a padded batch carries it), so a pad is never removed and a padded
    query removes nothing.

    Removal sets ``alpha[h,i,j] = 0`` without renormalising. The pairs compose with any other hooks.
    Where the model keeps a value bias, :func:`value_bias_keepers` follow the edits, so the masked output
    is ``sum_j alpha' vt_j + b_O + b_V W_O`` as on the model with its value biases folded.

    Raises:
        RuntimeError: the backend discards ``hook_pattern`` edits (TransformerLens 3.x's bridges, 4.x's
            BERT bridge), naming it and the hook point.
    """
    hooks = _masking_edits(
        model, mask=mask, ranking=ranking, rate=rate, mode=mode, layers=layers, n_sources=n_sources
    )
    edited = sorted({int(name.split(".")[1]) for name, _ in hooks})
    adapter(model).check_edits(edited, "hook_pattern", "source masking")
    before, after = value_bias_keepers(model, edited)
    return [*before, *hooks, *after]


def _masking_edits(
    model: Any,
    *,
    mask: Tensor | dict[int, Tensor] | None,
    ranking: Any,
    rate: float | None,
    mode: str,
    layers: int | Sequence[int] | None,
    n_sources: Tensor | None,
) -> list[FwdHook]:
    """The ``hook_pattern`` edits of :func:`masking_hooks` (same arguments), validated."""
    if (mask is None) == (ranking is None):
        raise ValueError("give exactly one of mask= (explicit boolean mask) or ranking= (with rate and mode)")
    hooks: list[FwdHook] = []
    if mask is not None:
        if rate is not None or n_sources is not None:
            raise ValueError("rate and n_sources apply to a ranking, not to an explicit mask")
        masks = mask if isinstance(mask, dict) else dict.fromkeys(resolve_layers(model, layers), mask)
        if isinstance(mask, dict):
            resolve_layers(model, list(mask))
            if layers is not None:
                raise ValueError("give layers either as the keys of the mask dict or as layers=, not both")
        for layer, m in masks.items():
            if not isinstance(m, Tensor) or m.dtype != torch.bool:
                raise TypeError(f"mask must be a boolean tensor, got {getattr(m, 'dtype', type(m))}")
            if m.ndim == 3:
                m = m[:, None]
            if m.ndim != 4 or m.shape[-1] != m.shape[-2]:
                raise ValueError(
                    f"mask must be [batch, head_index, q, k] or [batch, q, k] with q == k, got {tuple(m.shape)}"
                )
            hooks.append((hook_name(layer, "pattern"), partial(mask_sources_hook, mask=m)))
        return hooks
    assert ranking is not None
    if rate is None:
        raise ValueError("a ranking needs a removal rate in [0, 1]")
    check_mode(mode)
    chosen = ranking.layers if layers is None else resolve_layers(model, layers)
    missing = [la for la in chosen if la not in ranking.ranks]
    if missing:
        raise ValueError(f"layer(s) {missing} were not ranked; the ranking covers layers {ranking.layers}")
    if n_sources is None:
        n_sources = getattr(ranking, "n_sources", None)
    for layer in chosen:
        ranks = ranking.ranks[layer]
        lo, hi = _bounds(rate, mode, ranks, n_sources)
        fn = partial(ranked_mask_hook, ranks=ranks, lo=lo, hi=hi)
        hooks.append((hook_name(layer, "pattern"), fn))
    return hooks


class _ValueBiasKeeper:
    """Around an edit of ``blocks.{l}.attn.hook_pattern`` that does not renormalise: reads each row's mass
    before and after the edit and adds the removed share of the value bias, ``(sum_j alpha[h,i,j] − sum_j
    alpha'[h,i,j]) b_V[h]``, to ``hook_z``. The head outputs are then ``sum_j alpha' (v_j − b_V) + b_V``:
    the value bias stays outside ``o[i,h]`` (``docs/definitions.md`` §1.3). A row the edit leaves as it is
    gets exactly zero added."""

    def __init__(self, b_V: Float[Tensor, "head_index d_head"]) -> None:
        self.b_V = b_V
        self.mass: Tensor | None = None
        self.removed: Tensor | None = None

    def before(self, pattern: Pattern, hook: HookPoint) -> None:
        # pattern: [batch head_index query_pos key_pos] -> mass [batch head_index query_pos]
        self.mass = pattern.detach().sum(-1)

    def after(self, pattern: Pattern, hook: HookPoint) -> None:
        if self.mass is None:
            raise RuntimeError(
                f"{getattr(hook, 'name', 'hook_pattern')}: the mass before the edit was not read"
            )
        removed = self.mass - pattern.detach().sum(-1)  # [batch head_index query_pos]
        self.mass, self.removed = None, removed.transpose(1, 2)[..., None]  # [batch query_pos head_index 1]

    def add(self, z: Z, hook: HookPoint) -> Z:
        # z: [batch query_pos head_index d_head]
        if self.removed is None:
            raise RuntimeError(f"{getattr(hook, 'name', 'hook_z')} fired before its layer's hook_pattern")
        removed, self.removed = self.removed, None
        return z + (removed.float() * self.b_V.to(z.device, torch.float32)).to(z.dtype)


def value_bias_keepers(model: Any, layers: Iterable[int]) -> tuple[list[FwdHook], list[FwdHook]]:
    """Hooks that keep a value bias whole through pattern edits (none where the model has no ``b_V``).

    A ``hook_pattern`` edit that does not renormalise (source masking) scales the value bias of a model that
    keeps ``b_V`` in ``hook_v`` by the row's remaining mass; on the same model loaded with its value biases
    folded into ``b_O`` the bias stays whole. These hooks give the unfolded model the folded model's output.

    Args:
        model: the model the edits run on.
        layers: the layers whose ``hook_pattern`` is edited.

    Returns:
        ``(before, after)``: put ``before`` (a reader on ``hook_pattern`` per layer) before the pattern edits
        and ``after`` (a reader on ``hook_pattern`` and an adder on ``hook_z`` per layer) after them and
        before any reader. Both empty for a model without a value bias.
    """
    before: list[FwdHook] = []
    after: list[FwdHook] = []
    for layer in layers:
        b_V = adapter(model).value_bias(int(layer))
        if b_V is None:
            continue
        keeper = _ValueBiasKeeper(b_V.float())
        before.append((hook_name(int(layer), "pattern"), keeper.before))
        after += [(hook_name(int(layer), "pattern"), keeper.after), (hook_name(int(layer), "z"), keeper.add)]
    return before, after


# --------------------------------------------------------------------------- sink mass (hook_pattern)


#: Modes of the sink-value ablation (:func:`sink_value_hooks`).
ValueAblationMode = Literal["zero", "mean_norm", "scale", "unchanged"]


VALUE_ABLATION_MODES = ("zero", "mean_norm", "scale", "unchanged")


def set_sink_mass_hook(
    pattern: Pattern, hook: HookPoint, *, s: float, heads: list[int], sinks: list[int]
) -> Pattern:
    # pattern: [batch head q k]; for queries i in Q of the chosen heads: sink set -> total mass s
    # (keeping the proportions inside the set), the other real sources rescaled to total mass 1 - s.
    # Positions are inside each text: the pass' mask (current_pass_mask) puts text b's sink set at its own
    # padded positions; a pad is never a sink, a source or a query (its row and its weight 0 stay as they are).
    batch, pos = pattern.shape[0], pattern.shape[-1]
    sinks = resolve_sinks(sinks, pos)
    at = text_positions(current_pass_mask(pattern), batch, pos).to(pattern.device)  # [b k], -1 at a pad
    is_sink = torch.isin(at, torch.tensor(sinks, device=pattern.device))[:, None, None, :]  # [b 1 1 k]
    source = (at >= 0)[:, None, None, :] & ~is_sink  # real non-sink keys
    qmask = (at > max(sinks))[:, None, :, None]  # [b 1 q 1]: Q inside each text, never a pad
    sub = pattern[:, heads]  # [batch head' q k]
    sink_mass = (sub * is_sink).sum(-1, keepdim=True)  # [batch head' q 1]
    rest_mass = (sub * source).sum(-1, keepdim=True)
    ok = (sink_mass > 0) & (rest_mass > 0) & qmask
    scale = torch.where(
        is_sink,
        s / torch.where(sink_mass > 0, sink_mass, 1),
        torch.where(source, (1 - s) / torch.where(rest_mass > 0, rest_mass, 1), 1.0),
    )  # [batch head' q k]
    out = pattern.clone()
    out[:, heads] = torch.where(ok, sub * scale, sub)
    return out


def sink_mass_hooks(
    model: Any,
    s: float,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    sink_positions: int | Sequence[int] | None = None,
) -> list[FwdHook]:
    """Hooks on ``hook_pattern`` that set the sink mass of each query ``i in Q`` to ``s`` and rescale the
    other sources to ``1 - s``: ``alpha'[i,s'] = s·alpha[i,s']/sum_S alpha`` on the sink set,
    ``alpha'[i,j] = (1-s)·alpha[i,j]/sum_{∉S} alpha`` elsewhere. Then ``o'[i,h] = s vt_S[i] + (1-s) m[i]``,
    the convexity curve. Rows with a zero sink or non-sink mass and queries outside ``Q`` are left as
    they are. Only the chosen layers (default all) and heads (default all) change. The rows keep summing
    to 1, so a value bias stays ``b_V W_O``.

    **Padding.** ``sink_positions`` and ``Q`` are positions inside each text (``0`` = its first real token),
    placed per text from the mask of the pass: :func:`~mechgeom.hooks.run_hooks` ``(..., attention_mask=)``
    gives it, or wrap your own ``run_with_hooks`` in :func:`~mechgeom.hooks.pass_mask`; without one every
    position is real. A pad is never a sink, a source or a query: its row is untouched and its weight (0
    under the model's mask) is not rescaled.

    Args:
        model: the model the hooks are for.
        s: the sink mass, in ``[0, 1]``.
        layers, heads: where to intervene (default: every layer, every head).
        sink_positions: the sink set ``S`` (default ``[0]``).

    Returns:
        ``(hook_name, fn)`` pairs on ``blocks.{l}.attn.hook_pattern``.

    Raises:
        ValueError: ``s`` outside ``[0, 1]``; a bad sink set (:func:`~mechgeom.hooks.resolve_sinks`).
        RuntimeError: the backend discards ``hook_pattern`` edits, naming it and the hook point.
    """
    if not 0.0 <= float(s) <= 1.0:
        raise ValueError(f"sink mass s must lie in [0, 1], got {s}")
    fn = partial(
        set_sink_mass_hook, s=float(s), heads=resolve_heads(model, heads), sinks=resolve_sinks(sink_positions)
    )
    chosen = resolve_layers(model, layers)
    adapter(model).check_edits(chosen, "hook_pattern", "setting the sink mass")
    return [(hook_name(layer, "pattern"), fn) for layer in chosen]


# --------------------------------------------------------------------------- sink value (hook_v)


def n_kv_heads(model: Any) -> int:
    cfg = model.cfg
    if getattr(cfg, "ungroup_grouped_query_attention", False):
        return int(cfg.n_heads)
    return int(getattr(cfg, "n_key_value_heads", None) or cfg.n_heads)


def kv_groups(model: Any, heads: int | Sequence[int] | None = None) -> dict[int, list[int]]:
    """The KV heads behind ``heads`` and every query head that shares each of them.

    ``hook_v`` holds one value per KV head (GQA), so ablating the value of query head ``h`` ablates
    KV head ``h // (n_heads // n_kv)`` and with it the whole group. Without GQA each group is one head.
    """
    n_heads = int(model.cfg.n_heads)
    group = n_heads // n_kv_heads(model)
    kvs = sorted({h // group for h in resolve_heads(model, heads)})
    return {kv: list(range(kv * group, (kv + 1) * group)) for kv in kvs}


def affected_heads(model: Any, heads: int | Sequence[int] | None = None) -> list[int]:
    """Every query head whose output a value ablation of ``heads`` changes (their whole KV groups)."""
    return sorted(h for group in kv_groups(model, heads).values() for h in group)


def _positions_mask(positions: Tensor, batch: int, pos: int) -> Tensor:
    """``[batch, pos]`` bool from per-text positions ``[batch, n]`` (or shared ``[n]``)."""
    if positions.ndim == 1:
        positions = positions[None].expand(batch, -1)
    if positions.shape[0] != batch:
        raise ValueError(f"per-text positions have {positions.shape[0]} rows for a batch of {batch} texts")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= pos):
        raise ValueError(
            f"ablated positions {positions.unique().tolist()} outside the sequence (length {pos})"
        )
    mask = torch.zeros(batch, pos, dtype=torch.bool, device=positions.device)
    return mask.scatter(1, positions.long(), True)


def ablate_value_hook(
    v: Float[Tensor, "batch pos kv_head d_head"],
    hook: HookPoint,
    *,
    kv_heads: list[int],
    positions: Tensor,
    sinks: list[int],
    mode: str,
    scale: float,
    key_mask: Bool[Tensor, "batch pos"] | None = None,
    b_V: Float[Tensor, "head_index d_head"] | None = None,
) -> Float[Tensor, "batch pos kv_head d_head"]:
    # v: [batch pos kv_head d_head] (not GQA-expanded). Ablate v[b, p, kv] for p in positions[b].
    # key_mask [batch pos]: the real tokens; a pad is never a reference of "mean_norm" nor ablated.
    # b_V [head_index d_head] (per query head): the ablation acts on v - b_V, the bias is kept (§1.3).
    if mode == "unchanged":
        return v
    batch, pos, n_kv, _ = v.shape
    if b_V is not None:
        if b_V.shape[0] % n_kv:
            raise ValueError(f"b_V has {b_V.shape[0]} heads, not a multiple of hook_v's {n_kv} KV heads")
        bias = b_V[:: b_V.shape[0] // n_kv].to(v.device, v.dtype)  # [kv_head d_head]
        kw = dict(
            kv_heads=kv_heads, positions=positions, sinks=sinks, mode=mode, scale=scale, key_mask=key_mask
        )
        return ablate_value_hook(v - bias, hook, **kw) + bias  # type: ignore[arg-type]
    if max(kv_heads) >= n_kv:
        raise IndexError(f"KV head {max(kv_heads)} out of range for hook_v with {n_kv} KV heads")
    target = _positions_mask(positions.to(v.device), batch, pos)  # [b pos]
    real = None if key_mask is None else key_mask.to(v.device).bool()
    if real is not None:
        if tuple(real.shape) != (batch, pos):
            raise ValueError(f"key_mask {tuple(real.shape)} does not fit hook_v [batch={batch}, pos={pos}]")
        target = target & real
    kv_sel = torch.zeros(n_kv, dtype=torch.bool, device=v.device)
    kv_sel[kv_heads] = True
    sel = target[:, :, None] & kv_sel[None, None, :]  # [b pos kv]
    if mode == "zero":
        new = torch.zeros_like(v)
    elif mode == "scale":
        new = v * scale
    else:  # mean_norm: the mean value-space norm of the positions neither ablated nor sinks
        norms = v.norm(dim=-1)  # [b pos kv]
        ref = ~target & ~sink_mask(sinks, pos, v.device)[None, :]  # [b pos]
        if real is not None:
            ref = ref & real
        ref_norm = masked_mean(norms, ref[:, :, None].expand_as(norms), dim=1)  # [b kv]
        factor = torch.where(norms > 0, ref_norm[:, None, :] / norms.clamp_min(1e-30), 1.0)  # zero stays zero
        new = v * (scale * factor)[..., None]
    return torch.where(sel[..., None], new, v)


def sink_value_hooks(
    model: Any,
    *,
    layers: int | Sequence[int] | None = None,
    heads: int | Sequence[int] | None = None,
    mode: ValueAblationMode = "zero",
    scale: float = 1.0,
    sink_positions: int | Sequence[int] | None = None,
    positions: Sequence[int] | Tensor | None = None,
    key_mask: Bool[Tensor, "batch pos"] | None = None,
) -> list[FwdHook]:
    """Hooks on ``hook_v`` that ablate the sink value in ``layers`` and ``heads`` (default: all).

    Modes: ``"zero"`` sets ``v[s] = 0``; ``"mean_norm"`` rescales ``v[s]`` to ``scale`` times the mean
    value-space norm of the non-sink positions of the same text and KV head (a zero vector stays
    zero); ``"scale"`` multiplies ``v[s]`` by ``scale``; ``"unchanged"`` returns ``v`` untouched.
    ``mode="scale", scale=1`` and ``"unchanged"`` are the identity.

    GQA: ``hook_v`` is per KV head, so ablating head ``h`` ablates its whole KV group; see
    :func:`kv_groups` / :func:`affected_heads` for the query heads that change.

    ``positions`` replaces the sink set as the ablated positions (the random-position control):
    shared ``[n]`` or per text ``[batch, n]`` (then the batch must match). The norm reference of
    ``"mean_norm"`` excludes both the ablated positions and the sink set.

    ``key_mask`` (``[batch, pos]`` bools, True at real tokens; the batch must match) marks a padded batch's
    pads: a pad is never ablated and never part of the ``"mean_norm"`` reference.

    Where the model keeps a value bias in ``hook_v``, the modes act on ``v - b_V`` (``"zero"`` leaves
    ``v = b_V``), as on the model with its value biases folded (``docs/definitions.md`` §1.3).

    Raises:
        RuntimeError: the backend discards ``hook_v`` edits, naming it and the hook point.
    """
    if mode not in VALUE_ABLATION_MODES:
        raise ValueError(f"unknown ablation mode {mode!r}; choose from {list(VALUE_ABLATION_MODES)}")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    sinks = resolve_sinks(sink_positions)
    pos_t = torch.as_tensor(sinks if positions is None else positions, dtype=torch.long)
    fn = partial(
        ablate_value_hook,
        kv_heads=sorted(kv_groups(model, heads)),
        positions=pos_t,
        sinks=sinks,
        mode=mode,
        scale=float(scale),
        key_mask=key_mask,
    )
    chosen = resolve_layers(model, layers)
    adapter(model).check_edits(chosen, "hook_v", "sink-value ablation")
    backend = adapter(model)
    return [(hook_name(la, "v"), partial(fn, b_V=backend.value_bias(la))) for la in chosen]


# --------------------------------------------------------------------------- head removal (hook_z)


#: A head, ``(layer, head)``.
Head = tuple[int, int]


#: Modes of head removal (:func:`head_ablation_hooks`).
HeadAblationMode = Literal["zero", "mean"]


def resolve_head_set(model: Any, heads: Iterable[Head]) -> dict[int, list[int]]:
    """Validate a set of ``(layer, head)`` pairs and group it by layer (layers ascending, heads in given order).

    Raises ``IndexError`` for a layer or head out of range, ``ValueError`` for a duplicate pair or a pair
    that is not two integers.
    """
    by_layer: dict[int, list[int]] = {}
    for pair in heads:
        if len(pair) != 2:
            raise ValueError(f"a head is a (layer, head) pair, got {pair!r}")
        layer, head = int(pair[0]), int(pair[1])
        by_layer.setdefault(layer, []).append(head)
    if by_layer:
        resolve_layers(model, sorted(by_layer))
    for layer, hs in by_layer.items():
        try:
            resolve_heads(model, hs)
        except ValueError as err:
            raise ValueError(f"duplicate heads in layer {layer}: {err}") from None
        except IndexError as err:
            raise IndexError(f"layer {layer}: {err}") from None
    return {layer: by_layer[layer] for layer in sorted(by_layer)}


def replace_z_hook(z: Z, hook: HookPoint, *, heads: list[int], fill: Float[Tensor, "n d_head"] | None) -> Z:
    """Replace ``z[:, :, heads]`` by zeros (``fill is None``) or by ``fill[k]`` at every position."""
    # z: [batch pos head_index d_head]; fill: [len(heads) d_head], broadcast over batch and pos
    out = z.clone()
    if fill is None:
        out[:, :, heads] = 0.0
    else:
        out[:, :, heads] = fill.to(device=out.device, dtype=out.dtype)
    return out


def head_ablation_hooks(
    model: Any,
    heads: Iterable[Head],
    *,
    mode: HeadAblationMode = "zero",
    means: Any = None,
) -> list[FwdHook]:
    """``(hook_name, fn)`` pairs on ``blocks.{l}.attn.hook_z`` that remove the given heads.

    ``mode="zero"`` sets ``z[:, :, h] = 0``; ``mode="mean"`` sets it to ``means[l, h]`` at every position
    (``means`` is a :class:`HeadStats` or its ``z_mean`` tensor, see :func:`head_stats` for which positions
    are averaged). An empty set gives no hooks. Where the model keeps a value bias, ``z - b_V`` is what is
    removed: ``"zero"`` sets ``z = b_V``, ``"mean"`` sets it to ``means + b_V`` (``head_stats`` reads
    ``z - b_V``), as on the model loaded with its value biases folded (``docs/definitions.md`` §1.3).
    Raises ``IndexError``/``ValueError`` as :func:`resolve_head_set`, ``ValueError`` for a bad mode or
    missing/misshapen means, and ``RuntimeError`` where the backend discards ``hook_z`` edits.
    """
    by_layer = resolve_head_set(model, heads)
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    z_mean: Tensor | None = None
    if mode == "mean":
        if means is None:
            raise ValueError("mode='mean' needs means=head_stats(model, reference_tokens)")
        z_mean = getattr(means, "z_mean", means)  # a HeadStats or its z_mean tensor
        expected = (int(model.cfg.n_layers), int(model.cfg.n_heads), int(model.cfg.d_head))
        if tuple(z_mean.shape) != expected:
            raise ValueError(
                f"means must have shape [layer, head, d_head] = {expected}, got {tuple(z_mean.shape)}"
            )
    backend = adapter(model)
    backend.check_edits(list(by_layer), "hook_z", "head removal")
    hooks: list[FwdHook] = []
    for layer, hs in by_layer.items():
        fill = None if z_mean is None else z_mean[layer, hs].detach().clone()
        b_V = backend.value_bias(layer)
        if b_V is not None:  # z - b_V is removed (or set to its mean); b_V W_O stays with b_O (§1.3)
            bias = b_V[hs].to(torch.float32)
            fill = bias if fill is None else fill.to(bias.device, torch.float32) + bias
        hooks.append((hook_name(layer, "z"), partial(replace_z_hook, heads=list(hs), fill=fill)))
    return hooks
