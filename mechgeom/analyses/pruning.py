"""Head pruning (SPEC.md "Head pruning", paper B): removal hooks, head orders, retention curves, critical heads.

**Removing a head.** Head ``(l, h)`` is removed by a hook on ``blocks.{l}.attn.hook_z`` that replaces
``z[:, :, h]`` by zeros (``mode="zero"``, the SPEC default) or by a reference mean (``mode="mean"``). Because
``hook_attn_out = sum_h z[:, :, h] @ W_O[h] + b_O``, zeroing ``z`` deletes the head's output ``z @ W_O[h]``
and keeps ``b_O``. :func:`head_ablation_hooks` returns ordinary ``(hook_name, fn)`` pairs, one per layer
touched, so they compose with other hooks and with ``transformer_lens.patching``.

**Reference statistics** (:func:`head_stats`, one forward pass per batch of reference windows, no
unembedding). For every layer and head, averaged over *every window of the reference tokens and every
position* ``i >= start_pos`` (default ``start_pos=0``: all positions, the sink position 0 included):

- ``z_mean[l,h] = mean_{b, i} z[b,i,h]`` (``d_head``) — the value substituted by mean ablation at
  every position;
- ``out_norm[l,h] = mean_{b, i} ‖z[b,i,h] @ W_O[h]‖`` — the head-output norm of the taxonomy order;
- ``entropy[l,h] = mean_{b, i} H(alpha[b,h,i,:])`` with ``H(p) = -sum_j p_j log p_j`` (nats, ``0 log 0 = 0``).
  Query 0 attends only to itself, so its entropy is 0 for every head; including it rescales every head's
  mean by the same factor and leaves the entropy order unchanged.

**Orders** (lists of ``(layer, head)``, the first removed first; ties broken by ascending ``(layer, head)``):

- ``taxonomy``: Reset first, then Mixer, then Retriever; inside a regime ascending ``out_norm``;
- ``magnitude``: ascending ``‖W_V[h] W_O[h]‖_F`` (GQA: ``W_V`` of the head's KV group);
- ``entropy``: descending mean attention entropy (the least selective, most diffuse heads first);
  ``highest_first=False`` reverses it;
- ``random``: a seeded permutation;
- ``single_head``: ascending single-head ablation ``ΔPPL`` (the reference: least harmful first).

**Retention.** At retention ``r`` the model keeps ``n_kept = round_half_up(r * N)`` of its ``N`` heads and
removes the first ``N - n_kept`` heads of the order (:func:`retention_levels`).

**Critical heads.** The single-head leaderboard flags a head as critical when
``ΔPPL > median + k * MAD`` over all heads, ``MAD = 1.4826 * median |ΔPPL - median|`` (the scaled MAD, a
consistent estimate of the standard deviation for normal data), ``k = 5`` (:func:`mad_outliers`).

**Speed.** Removing a head of layer ``l`` changes nothing before layer ``l``. :func:`single_head_sweep`
therefore runs the clean model block by block, keeps only the residual stream at the current layer's input
(``blocks.{l}.hook_resid_pre``) and runs each of layer ``l``'s ablations from there with
``model(resid, start_at_layer=l, tokens=..., return_type="loss")``; the result equals the full forward.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import einops
import numpy as np
import pandas as pd
import torch
from transformer_lens.hook_points import HookPoint

from mechgeom._progress import progress
from mechgeom.analyses.evaluation import text_nll
from mechgeom.data import TaskItem
from mechgeom.hooks import (
    FwdHook,
    Head,
    HeadAblationMode,
    head_ablation_hooks,
    head_outputs,
    hook_name,
    layer_W_O,
    resolve_head_set,
    run_hooks,
    to_tokens,
)
from mechgeom.models import is_bridge
from mechgeom.sweep import Item, LocalExecutor, RowStore, model_label, run_sweep, tokens_hash
from mechgeom.typing import WO, Float, Pattern, Tensor, Tokens, Z

__all__ = [
    "ORDERS",
    "REGIMES",
    "RETENTION_LEVELS",
    "Head",
    "HeadStats",
    "RetentionCurves",
    "SingleHeadResult",
    "entropy_order",
    "head_ablation_hooks",
    "head_orders",
    "head_output_norm",
    "head_stats",
    "mad_outliers",
    "magnitude_order",
    "pattern_entropy",
    "random_order",
    "resolve_head_set",
    "retention_curve",
    "retention_curves",
    "retention_levels",
    "score_choices",
    "single_head_order",
    "single_head_sweep",
    "task_accuracy",
    "taxonomy_order",
    "weight_magnitude",
]

#: Head removal modes (defined with the intervention in :mod:`mechgeom.hooks.interventions`).
AblationMode = HeadAblationMode
#: The taxonomy order's regimes, the first removed first.
REGIMES = ("Reset", "Mixer", "Retriever")
#: The orders :func:`head_orders` builds.
ORDERS = ("taxonomy", "magnitude", "entropy", "random", "single_head")
#: 100%, 90%, ..., 10% of the heads kept.
RETENTION_LEVELS = tuple(k / 10 for k in range(10, 0, -1))
#: Scale that makes the MAD a consistent estimate of the standard deviation for normal data.
MAD_SCALE = 1.4826


# --------------------------------------------------------------------------- head sets and removal hooks


def _all_heads(model: Any) -> list[Head]:
    return [
        (layer, head) for layer in range(int(model.cfg.n_layers)) for head in range(int(model.cfg.n_heads))
    ]


# --------------------------------------------------------------------------- per-head formulas


def head_output_norm(z: Z, W_O: WO) -> Float[Tensor, "batch pos head_index"]:
    """Head-output norm ``‖o[i,h]‖ = ‖z[i,h] @ W_O[h]‖`` (bias excluded)."""
    return head_outputs(z, W_O).norm(dim=-1)


def pattern_entropy(pattern: Pattern) -> Float[Tensor, "batch head_index query_pos"]:
    """Attention entropy of each pattern row, ``H(alpha[h,i,:]) = -sum_j alpha[h,i,j] log alpha[h,i,j]`` (nats, ``0 log 0 = 0``)."""
    p = pattern.double()
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, 1.0)), torch.zeros_like(p))
    return -plogp.sum(dim=-1)


def weight_magnitude(model: Any) -> Float[Tensor, "layer head_index"]:
    """``‖W_V[h] W_O[h]‖_F`` per layer and head.

    GQA: ``W_V`` is stored per KV head (``blocks[l].attn._W_V``, ``[n_kv, d_model, d_head]``); query head
    ``h`` uses KV head ``h // (n_heads // n_kv)`` (``repeat_interleave``, as TransformerLens). Computed
    without the ``d_model x d_model`` product: ``‖W_V W_O‖_F² = sum((W_Vᵀ W_V) ⊙ (W_O W_Oᵀ))``.
    """
    n_heads = int(model.cfg.n_heads)
    rows = []
    for layer in range(int(model.cfg.n_layers)):
        attn = model.blocks[layer].attn
        W_V = getattr(attn, "_W_V", None)
        if not isinstance(W_V, Tensor):
            W_V = attn.W_V
        W_V = W_V.detach().double()  # [kv_head d_model d_head]
        if W_V.shape[0] != n_heads:
            W_V = W_V.repeat_interleave(n_heads // W_V.shape[0], dim=0)
        W_O = layer_W_O(model, layer).detach().double()  # [head d_head d_model]
        gram_v = einops.einsum(W_V, W_V, "head d_model a, head d_model b -> head a b")
        gram_o = einops.einsum(W_O, W_O, "head a d_model, head b d_model -> head a b")
        rows.append((gram_v * gram_o).sum(dim=(1, 2)).clamp_min(0).sqrt())
    return torch.stack(rows).float()


# --------------------------------------------------------------------------- reference statistics


@dataclass
class HeadStats:
    """Per-head reference statistics (see the module docstring for exactly which positions are averaged)."""

    z_mean: Float[Tensor, "layer head_index d_head"]
    out_norm: Float[Tensor, "layer head_index"]
    entropy: Float[Tensor, "layer head_index"]
    n_positions: int
    start_pos: int = 0

    def to_frame(self) -> pd.DataFrame:
        """One row per head: ``layer, head, out_norm, entropy``."""
        n_layers, n_heads = self.out_norm.shape
        return pd.DataFrame(
            {
                "layer": np.repeat(np.arange(n_layers), n_heads),
                "head": np.tile(np.arange(n_heads), n_layers),
                "out_norm": self.out_norm.flatten().cpu().numpy(),
                "entropy": self.entropy.flatten().cpu().numpy(),
            }
        )


class _StatsAccumulator:
    def __init__(self, model: Any, start_pos: int) -> None:
        n_layers, n_heads, d_head = int(model.cfg.n_layers), int(model.cfg.n_heads), int(model.cfg.d_head)
        self.model = model
        self.start_pos = start_pos
        self.z_sum = torch.zeros(n_layers, n_heads, d_head, dtype=torch.float64)
        self.norm_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.entropy_sum = torch.zeros(n_layers, n_heads, dtype=torch.float64)
        self.n_z = 0
        self.n_q = 0

    def on_z(self, z: Z, hook: HookPoint, *, layer: int) -> None:
        # z: [batch pos head_index d_head]
        zs = z.detach()[:, self.start_pos :]
        self.z_sum[layer] += zs.double().sum(dim=(0, 1)).cpu()
        W_O = layer_W_O(self.model, layer).detach()
        self.norm_sum[layer] += head_output_norm(zs, W_O).double().sum(dim=(0, 1)).cpu()
        if layer == 0:
            self.n_z += zs.shape[0] * zs.shape[1]

    def on_pattern(self, pattern: Pattern, hook: HookPoint, *, layer: int) -> None:
        # pattern: [batch head_index query_pos key_pos]
        ent = pattern_entropy(pattern.detach()[:, :, self.start_pos :])  # [batch head q]
        self.entropy_sum[layer] += ent.sum(dim=(0, 2)).cpu()
        if layer == 0:
            self.n_q += ent.shape[0] * ent.shape[2]

    def fwd_hooks(self) -> list[FwdHook]:
        hooks: list[FwdHook] = []
        for layer in range(int(self.model.cfg.n_layers)):
            hooks.append((hook_name(layer, "pattern"), partial(self.on_pattern, layer=layer)))
            hooks.append((hook_name(layer, "z"), partial(self.on_z, layer=layer)))
        return hooks


def head_stats(
    model: Any, tokens: Tokens, *, start_pos: int = 0, batch_size: int = 8, verbose: bool = False
) -> HeadStats:
    """Reference statistics of every head over ``tokens`` ``[n_texts, pos]``, one pass per batch.

    Averages over every window and every position ``i >= start_pos``: ``z_mean`` (mean ``z[b,i,h]``),
    ``out_norm`` (mean ``‖z[b,i,h] @ W_O[h]‖``, :func:`head_output_norm`) and ``entropy`` (mean
    :func:`pattern_entropy` over query rows ``i >= start_pos``). The forward stops before the unembedding.
    """
    if start_pos < 0:
        raise ValueError(f"start_pos must be >= 0, got {start_pos}")
    tokens = to_tokens(
        model, tokens, min_pos=start_pos + 1, what=f"head statistics from start_pos={start_pos}"
    )
    if not 0 <= start_pos < tokens.shape[1]:
        raise ValueError(f"start_pos={start_pos} leaves no position of {tokens.shape[1]}")
    acc = _StatsAccumulator(model, start_pos)
    starts = range(0, tokens.shape[0], batch_size)
    for start in progress(starts, desc="head stats", enabled=verbose, total=len(starts)):
        batch = tokens[start : start + batch_size].to(model.cfg.device)
        run_hooks(model, batch, acc.fwd_hooks(), return_type=None)
    return HeadStats(
        z_mean=(acc.z_sum / acc.n_z).float(),
        out_norm=(acc.norm_sum / acc.n_z).float(),
        entropy=(acc.entropy_sum / acc.n_q).float(),
        n_positions=acc.n_z,
        start_pos=start_pos,
    )


# --------------------------------------------------------------------------- orders


def _order_by(scores: Tensor | np.ndarray, *, descending: bool = False) -> list[Head]:
    """All heads sorted by ``scores[l, h]`` (ascending unless ``descending``), ties by ``(layer, head)``."""
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
    """Ascending ``‖W_V[h] W_O[h]‖_F`` (:func:`weight_magnitude`): the smallest is removed first."""
    return _order_by(weight_magnitude(model))


def entropy_order(entropy: HeadStats | Tensor, *, highest_first: bool = True) -> list[Head]:
    """By mean attention entropy (:func:`head_stats`); by default the highest (least selective) first."""
    ent = entropy.entropy if isinstance(entropy, HeadStats) else entropy
    return _order_by(ent, descending=highest_first)


def random_order(model: Any, seed: int = 0) -> list[Head]:
    """A uniformly random permutation of all heads, reproducible from ``seed`` (numpy ``default_rng``)."""
    heads = _all_heads(model)
    perm = np.random.default_rng(seed).permutation(len(heads))
    return [heads[k] for k in perm]


def single_head_order(sweep: SingleHeadResult) -> list[Head]:
    """Ascending single-head ablation ``ΔPPL``: the head whose removal alone hurts least goes first."""
    if torch.isnan(sweep.nll).any():
        raise ValueError("the sweep did not cover every head; run single_head_sweep with heads=None")
    return _order_by(sweep.delta_ppl)


def head_orders(
    model: Any,
    stats: HeadStats,
    *,
    taxonomy: pd.DataFrame | None = None,
    sweep: SingleHeadResult | None = None,
    seed: int = 0,
    entropy_highest_first: bool = True,
) -> dict[str, list[Head]]:
    """Every order that the inputs allow: magnitude, entropy, random always; taxonomy and single_head if given."""
    orders: dict[str, list[Head]] = {}
    if taxonomy is not None:
        orders["taxonomy"] = taxonomy_order(taxonomy, stats.out_norm)
    orders["magnitude"] = magnitude_order(model)
    orders["entropy"] = entropy_order(stats, highest_first=entropy_highest_first)
    orders["random"] = random_order(model, seed)
    if sweep is not None:
        orders["single_head"] = single_head_order(sweep)
    return orders


# --------------------------------------------------------------------------- critical heads


def mad_outliers(values: Tensor | np.ndarray, *, k: float = 5.0, scale: float = MAD_SCALE) -> dict[str, Any]:
    """Robust outlier flag: ``x > median + k * MAD`` with ``MAD = scale * median |x - median|``.

    ``scale = 1.4826`` makes the MAD a consistent estimate of the standard deviation for normal data.
    Returns ``flags`` (bool array), ``threshold``, ``median``, ``mad`` (scaled) and ``robust_z``
    (``(x - median) / MAD``; ``inf``/NaN where ``MAD = 0``). With ``MAD = 0`` every value above the
    median is flagged. NaNs are ignored for the median and never flagged.
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


# --------------------------------------------------------------------------- single-head sweep


_FRESH = "delete it or choose another checkpoint="


def _tokens_key(tokens: Tokens) -> str:
    return f"{tuple(tokens.shape)}:{tokens_hash(tokens)}"


@dataclass
class _HeadWork:
    """The work of one single-head item: every text's NLL with head ``item.key`` removed (picklable).

    On the ``start_at_layer`` path the clean residual stream of every batch is cached per worker at the
    input of the last layer asked for and advanced block by block (restarted from the embeddings when an
    earlier layer is asked for)."""

    tokens: Tokens
    mode: AblationMode
    means: HeadStats | Tensor | None
    batch_size: int
    use_resid: bool
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def _resid(self, model: Any, layer: int) -> tuple[Tokens, list[slice], list[Tensor]]:
        c = self._cache
        if c.get("layer", layer + 1) > layer:  # start (again) from the embeddings
            n = self.tokens.shape[0]
            c["toks"] = self.tokens.to(model.cfg.device)
            c["batches"] = [slice(s, min(s + self.batch_size, n)) for s in range(0, n, self.batch_size)]
            with torch.no_grad():
                c["resid"] = [run_hooks(model, c["toks"][sl], [], stop_at_layer=0) for sl in c["batches"]]
            c["layer"] = 0
        while c["layer"] < layer:
            with torch.no_grad():
                c["resid"] = [
                    model(r, start_at_layer=c["layer"], stop_at_layer=c["layer"] + 1) for r in c["resid"]
                ]
            c["layer"] += 1
        return c["toks"], c["batches"], c["resid"]

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        layer, h = item.key
        hooks = head_ablation_hooks(model, [(layer, h)], mode=self.mode, means=self.means)
        if self.use_resid:
            toks, batches, resid = self._resid(model, layer)
            nll = torch.cat(
                [
                    _nll_from_layer(model, r, toks[sl], layer, hooks)
                    for r, sl in zip(resid, batches, strict=True)
                ]
            )
        else:
            nll = text_nll(model, self.tokens, hooks, batch_size=self.batch_size)
        n = self.tokens.shape[0]
        return pd.DataFrame({"layer": layer, "head": h, "text": np.arange(n), "nll": nll.double().numpy()})


def _nll_from_layer(
    model: Any,
    resid: Float[Tensor, "batch pos d_model"],
    tokens: Tokens,
    layer: int,
    fwd_hooks: Sequence[FwdHook],
) -> Float[Tensor, " batch"]:
    """Mean next-token NLL per text, running the model from ``resid`` = ``blocks.{layer}.hook_resid_pre``.

    Same loss as :func:`mechgeom.analyses.evaluation.text_nll` (TransformerLens' per-token loss, mean over positions).
    """
    with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
        loss = model(resid, start_at_layer=layer, tokens=tokens, return_type="loss", loss_per_token=True)
    return loss.float().mean(dim=-1).cpu()


@dataclass
class SingleHeadResult:
    """Single-head ablation NLLs: ``nll[l, h, t]`` is text ``t``'s mean NLL with head ``(l, h)`` removed."""

    clean_nll: Float[Tensor, " text"]
    nll: Float[Tensor, "layer head_index text"]
    mode: str = "zero"

    @property
    def clean_ppl(self) -> float:
        return float(torch.exp(self.clean_nll.mean()))

    @property
    def ppl(self) -> Float[Tensor, "layer head_index"]:
        """``exp`` of the mean NLL over texts (equal-length windows), as :func:`mechgeom.analyses.evaluation.perplexity`."""
        return torch.exp(self.nll.mean(dim=-1))

    @property
    def delta_ppl(self) -> Float[Tensor, "layer head_index"]:
        """``ΔPPL = PPL(head removed) − PPL(clean)``."""
        return self.ppl - self.clean_ppl

    @property
    def delta_nll(self) -> Float[Tensor, "layer head_index"]:
        return self.nll.mean(dim=-1) - self.clean_nll.mean()

    def to_frame(self, *, k: float = 5.0) -> pd.DataFrame:
        """The leaderboard, most harmful first: ``rank, layer, head, ppl, delta_ppl, delta_nll,
        ratio_to_median, robust_z, critical`` (:func:`mad_outliers` on ``delta_ppl`` with this ``k``)."""
        n_layers, n_heads = self.delta_ppl.shape
        d = self.delta_ppl.flatten().numpy()
        out = mad_outliers(d, k=k)
        df = pd.DataFrame(
            {
                "layer": np.repeat(np.arange(n_layers), n_heads),
                "head": np.tile(np.arange(n_heads), n_layers),
                "ppl": self.ppl.flatten().numpy(),
                "delta_ppl": d,
                "delta_nll": self.delta_nll.flatten().numpy(),
                "ratio_to_median": d / out["median"] if out["median"] != 0 else np.nan,
                "robust_z": out["robust_z"],
                "critical": out["flags"],
            }
        )
        df = df.dropna(subset=["delta_ppl"]).sort_values(
            ["delta_ppl", "layer", "head"], ascending=[False, True, True]
        )
        df.insert(0, "rank", np.arange(1, len(df) + 1))
        df["clean_ppl"] = self.clean_ppl
        df["mode"] = self.mode
        df["k"] = k
        df["threshold"] = out["threshold"]
        return df.reset_index(drop=True)

    def critical(self, *, k: float = 5.0) -> pd.DataFrame:
        """The flagged rows of :meth:`to_frame`."""
        df = self.to_frame(k=k)
        return df[df["critical"]].reset_index(drop=True)


def single_head_sweep(
    model: Any,
    tokens: Tokens,
    *,
    heads: Iterable[Head] | None = None,
    mode: AblationMode = "zero",
    means: HeadStats | Tensor | None = None,
    batch_size: int = 8,
    start_at_layer: bool = True,
    checkpoint: str | Path | None = None,
    verbose: bool = False,
) -> SingleHeadResult:
    """NLL of every text with each head removed alone (``heads=None``: all heads), plus the clean NLL.

    With ``start_at_layer`` (default) the clean residual stream is advanced block by block over all texts
    and each head of layer ``l`` is evaluated from ``blocks.{l}.hook_resid_pre`` (exact: earlier layers do
    not see the removal); otherwise every head costs one full forward through
    :func:`mechgeom.analyses.evaluation.text_nll` (always so on a ``TransformerBridge``, where that is the faster
    path). ``checkpoint`` (a ``.csv``/``.parquet`` path) records each head's rows as soon as it finishes
    and resumes from them (:mod:`mechgeom.sweep`); a file written for another model, other tokens or
    another mode is refused with a ``ValueError`` naming the difference.
    """
    tokens = to_tokens(model, tokens, min_pos=2, what="the single-head sweep (a token to predict)")
    n_layers, n_heads, n_texts = int(model.cfg.n_layers), int(model.cfg.n_heads), tokens.shape[0]
    wanted = resolve_head_set(model, _all_heads(model) if heads is None else heads)
    head_ablation_hooks(model, [], mode=mode, means=means)  # checks mode and means before any work
    settings = {
        "model": model_label(model),
        "heads": f"{n_layers}x{n_heads}",
        "tokens": _tokens_key(tokens),
        "mode": mode,
    }
    store = RowStore(
        checkpoint, key=["layer", "head", "text"], settings=settings, what="checkpoint", fresh=_FRESH
    )
    items = [
        Item(key=(layer, h), rows=tuple((layer, h, t) for t in range(n_texts)))
        for layer, hs in wanted.items()
        for h in hs
    ]
    clean = text_nll(model, tokens, batch_size=batch_size)
    # A bridge has no start_at_layer (TL 3.x) or still runs the earlier blocks with it (TL 4.x, 4x slower):
    # full forwards are its fast path.
    use_resid = (
        start_at_layer
        and not is_bridge(model)
        and getattr(model.cfg, "positional_embedding_type", "") != "shortformer"
    )
    work = _HeadWork(tokens, mode, means, batch_size, use_resid)
    run_sweep(items, work, store, executor=LocalExecutor(model), desc="single-head sweep", verbose=verbose)
    nll = torch.full((n_layers, n_heads, n_texts), float("nan"))
    done = store.frame
    for a, b, c, v in zip(*(done[k].to_numpy() for k in ("layer", "head", "text", "nll")), strict=True):
        nll[int(a), int(b), int(c)] = float(v)
    return SingleHeadResult(clean_nll=clean, nll=nll, mode=mode)


# --------------------------------------------------------------------------- downstream scoring


def _encode_items(
    model: Any, items: Sequence[TaskItem], max_tokens: int | None
) -> list[tuple[list[int], list[list[int]]]]:
    """Token ids of each item's prompt (model's BOS default) and of each choice (no BOS)."""
    out = []
    for item in items:
        prompt = model.to_tokens(item.prompt, truncate=False)[0].tolist()
        choices = [model.to_tokens(c, prepend_bos=False, truncate=False)[0].tolist() for c in item.choices]
        limit = max_tokens if max_tokens is not None else int(model.cfg.n_ctx)
        keep = limit - max(len(c) for c in choices)
        if keep < 1:
            raise ValueError(f"a choice of {item.task!r} is longer than max_tokens={limit}")
        out.append((prompt[-keep:], choices))  # left-truncate long prompts
    return out


def score_choices(
    model: Any,
    items: Sequence[TaskItem] | Sequence[tuple[list[int], list[list[int]]]],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
) -> Float[Tensor, "item choice"]:
    """Summed log-likelihood of each choice's tokens given the prompt, ``log p(choice | prompt)``.

    ``items`` are :class:`~mechgeom.data.TaskItem` (tokenised here: the prompt with the model's BOS default,
    each choice without BOS; prompts longer than ``max_tokens`` are cut from the left) or already tokenised
    ``(prompt_ids, [choice_ids, ...])``. Where every choice of an item is one token, one forward of the prompt
    scores all of them (from the last position); otherwise each ``prompt + choice`` is one sequence. Sequences
    are sorted by length and right-padded; with causal attention the padding never reaches a scored position.
    Every item must have the same number of choices.
    """
    if not items:
        raise ValueError("no items to score")
    encoded = cast(list[tuple[list[int], list[list[int]]]], list(items))
    enc = _encode_items(model, items, max_tokens) if isinstance(items[0], TaskItem) else encoded  # type: ignore[arg-type]
    n_choices = {len(c) for _, c in enc}
    if len(n_choices) != 1:
        raise ValueError(f"items have different numbers of choices: {sorted(n_choices)}")
    if any(not p or not ch for p, chs in enc for ch in chs):
        raise ValueError("every prompt and every choice needs at least one token")
    # a job: (sequence ids, [(item, choice, scored positions, target ids)])
    jobs: list[tuple[list[int], list[tuple[int, int, list[int], list[int]]]]] = []
    for i, (p, chs) in enumerate(enc):
        if all(len(ch) == 1 for ch in chs):
            jobs.append((p, [(i, c, [len(p) - 1], ch) for c, ch in enumerate(chs)]))
        else:
            jobs += [
                (p + ch, [(i, c, list(range(len(p) - 1, len(p) - 1 + len(ch))), ch)])
                for c, ch in enumerate(chs)
            ]
    jobs.sort(key=lambda job: len(job[0]))
    scores = torch.full((len(enc), n_choices.pop()), float("nan"), dtype=torch.float64)
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        batch = torch.zeros(len(chunk), max(len(ids) for ids, _ in chunk), dtype=torch.long)
        for row, (ids, _) in enumerate(chunk):
            batch[row, : len(ids)] = torch.tensor(ids)
        logits = run_hooks(
            model, batch.to(model.cfg.device), fwd_hooks, return_type="logits"
        )  # [batch pos vocab]
        for row, (_, targets) in enumerate(chunk):
            for i, c, pos, tgt in targets:
                logp = torch.log_softmax(logits[row, pos].double(), dim=-1).cpu()  # [n_scored vocab]
                scores[i, c] = logp[torch.arange(len(tgt)), torch.tensor(tgt)].sum()
    return scores


def task_accuracy(
    model: Any,
    items: Sequence[TaskItem],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    batch_size: int = 8,
    max_tokens: int | None = None,
    encoded: Sequence[tuple[list[int], list[list[int]]]] | None = None,
) -> float:
    """Share of items whose highest-scoring choice (:func:`score_choices`) is the gold answer."""
    scores = score_choices(
        model,
        encoded if encoded is not None else items,
        fwd_hooks,
        batch_size=batch_size,
        max_tokens=max_tokens,
    )
    gold = torch.tensor([item.answer for item in items])
    return float((scores.argmax(dim=1) == gold).double().mean())


# --------------------------------------------------------------------------- retention curves


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


def _check_order(model: Any, order: Sequence[Head]) -> list[Head]:
    resolve_head_set(model, order)
    order = [(int(a), int(b)) for a, b in order]
    n = int(model.cfg.n_layers) * int(model.cfg.n_heads)
    if len(order) != n:
        raise ValueError(f"an order must list all {n} heads, got {len(order)}")
    return order


@dataclass
class _Clean:
    nll: dict[str, float] = field(default_factory=dict)
    accuracy: float | None = None


def retention_curve(
    model: Any,
    order: Sequence[Head],
    corpora: Mapping[str, Tokens],
    *,
    name: str = "order",
    levels: Sequence[float] = RETENTION_LEVELS,
    mode: AblationMode = "zero",
    means: HeadStats | Tensor | None = None,
    task: tuple[str, Sequence[TaskItem]] | None = None,
    batch_size: int = 8,
    extra_hooks: Sequence[FwdHook] = (),
    clean: _Clean | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """PPL on each corpus (and accuracy on ``task = (task_name, items)``) as the heads of ``order`` are removed.

    Tidy rows: ``order, retention, n_heads_kept, n_heads_removed, corpus, nll, ppl, delta_ppl, accuracy,
    delta_accuracy`` — corpus rows have NaN accuracy, task rows (``corpus`` = task name) NaN PPL. Deltas are
    against the clean model with ``extra_hooks`` still attached.
    """
    order = _check_order(model, order)
    corpora = {
        c: to_tokens(model, t, min_pos=2, what=f"corpus {c!r} (a token to predict)")
        for c, t in corpora.items()
    }
    n_total = len(order)
    encoded = _encode_items(model, task[1], None) if task is not None else None
    if clean is None:
        clean = _Clean()
    if any(c not in clean.nll for c in corpora) or (task is not None and clean.accuracy is None):
        for corpus, toks in corpora.items():
            clean.nll[corpus] = float(text_nll(model, toks, extra_hooks, batch_size=batch_size).mean())
        if task is not None and encoded is not None:
            clean.accuracy = task_accuracy(
                model, task[1], extra_hooks, batch_size=batch_size, encoded=encoded
            )
    rows = []
    for retention, n_kept in progress(
        retention_levels(n_total, levels), desc=f"retention {name}", enabled=verbose
    ):
        removed = order[: n_total - n_kept]
        hooks = head_ablation_hooks(model, removed, mode=mode, means=means) + list(extra_hooks)
        base = {
            "order": name,
            "retention": retention,
            "n_heads_kept": n_kept,
            "n_heads_removed": n_total - n_kept,
        }
        for corpus, toks in corpora.items():
            nll = (
                clean.nll[corpus]
                if not removed
                else float(text_nll(model, toks, hooks, batch_size=batch_size).mean())
            )
            rows.append(
                {
                    **base,
                    "corpus": corpus,
                    "nll": nll,
                    "ppl": math.exp(nll),
                    "delta_ppl": math.exp(nll) - math.exp(clean.nll[corpus]),
                    "accuracy": math.nan,
                    "delta_accuracy": math.nan,
                }
            )
        if task is not None and encoded is not None and clean.accuracy is not None:
            acc = (
                clean.accuracy
                if not removed
                else task_accuracy(model, task[1], hooks, batch_size=batch_size, encoded=encoded)
            )
            rows.append(
                {
                    **base,
                    "corpus": task[0],
                    "nll": math.nan,
                    "ppl": math.nan,
                    "delta_ppl": math.nan,
                    "accuracy": acc,
                    "delta_accuracy": acc - clean.accuracy,
                }
            )
    return pd.DataFrame(rows)


@dataclass
class RetentionCurves:
    """Retention curves of several orders (one tidy frame) and the number of heads of the model."""

    frame: pd.DataFrame
    n_heads: int
    mode: str = "zero"

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary(self) -> pd.DataFrame:
        """Per order and corpus/task: mean ``ΔPPL`` (or mean accuracy) over the retention levels below 100%."""
        df = self.frame[self.frame["retention"] < 1.0]
        return (
            df.groupby(["corpus", "order"], sort=False)
            .agg(mean_delta_ppl=("delta_ppl", "mean"), mean_accuracy=("accuracy", "mean"))
            .reset_index()
        )


def retention_curves(
    model: Any,
    orders: Mapping[str, Sequence[Head]],
    corpora: Mapping[str, Tokens],
    *,
    levels: Sequence[float] = RETENTION_LEVELS,
    mode: AblationMode = "zero",
    means: HeadStats | Tensor | None = None,
    task: tuple[str, Sequence[TaskItem]] | None = None,
    batch_size: int = 8,
    checkpoint: str | Path | None = None,
    on_order: Callable[[pd.DataFrame], None] | None = None,
    verbose: bool = False,
) -> RetentionCurves:
    """:func:`retention_curve` for every order, the clean pass shared; resumable.

    ``checkpoint`` (``.csv``/``.parquet``) holds the rows of the orders already finished
    (:mod:`mechgeom.sweep`); they are read back, kept in the result (also orders not in ``orders``) and not
    recomputed; an order absent from it is run. The file is tied to the model, the corpora (by token
    content), the levels, the mode and the task items: another run's file is refused with a ``ValueError``
    naming each difference.
    ``on_order(frame_so_far)`` runs after each order.
    """
    n_total = int(model.cfg.n_layers) * int(model.cfg.n_heads)
    corpora = {
        c: to_tokens(model, t, min_pos=2, what=f"corpus {c!r} (a token to predict)")
        for c, t in corpora.items()
    }
    levels_t = retention_levels(n_total, levels)
    names = [*corpora, *([task[0]] if task is not None else [])]
    settings = {
        "model": model_label(model),
        "heads": f"{model.cfg.n_layers}x{model.cfg.n_heads}",
        "corpora": ";".join(f"{c}={_tokens_key(t)}" for c, t in corpora.items()),
        "levels": ",".join(str(round(r, 10)) for r, _ in levels_t),
        "mode": mode,
        "task": "none" if task is None else f"{task[0]}={_items_key(task[1])}",
    }
    store = RowStore(
        checkpoint, key=["order", "retention", "corpus"], settings=settings, what="checkpoint", fresh=_FRESH
    )
    items = [
        Item(key=(name,), rows=tuple((name, r, c) for r, _ in levels_t for c in names), data=list(order))
        for name, order in orders.items()
    ]
    work = _RetentionWork(corpora, tuple(levels), mode, means, task, batch_size, verbose)
    after = None if on_order is None else (lambda _item, _rows: on_order(store.rows()))
    run_sweep(
        items,
        work,
        store,
        executor=LocalExecutor(model),
        desc="retention curves",
        verbose=verbose,
        on_item=after,
    )
    frame = store.rows() if len(store.frame) else pd.DataFrame()
    return RetentionCurves(frame=frame, n_heads=n_total, mode=mode)


def _items_key(items: Sequence[TaskItem]) -> str:
    """Content hash of task items (task, prompt, choices, answer)."""
    text = repr([(it.task, it.prompt, tuple(it.choices), int(it.answer)) for it in items])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass
class _RetentionWork:
    """The work of one retention item: :func:`retention_curve` of the order ``item.data`` named
    ``item.key[0]`` (picklable); the clean NLLs and accuracy are cached per worker."""

    corpora: dict[str, Tokens]
    levels: tuple[float, ...]
    mode: AblationMode
    means: HeadStats | Tensor | None
    task: tuple[str, Sequence[TaskItem]] | None
    batch_size: int
    verbose: bool
    _clean: _Clean = field(default_factory=_Clean, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clean": _Clean()}

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        return retention_curve(
            model, item.data, self.corpora, name=item.key[0], levels=self.levels, mode=self.mode,
            means=self.means, task=self.task, batch_size=self.batch_size, clean=self._clean,
            verbose=self.verbose,
        )  # fmt: skip
