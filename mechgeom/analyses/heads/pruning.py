"""Head pruning (``docs/definitions.md`` §7, paper B): the single-head sweep, retention curves, critical heads.

**Removing a head.** Head ``(l, h)`` is removed by a hook on ``blocks.{l}.attn.hook_z`` that replaces
``z[:, :, h]`` by zeros (``mode="zero"``, the default, §7.1) or by a reference mean (``mode="mean"``). Because
``hook_attn_out = sum_h z[:, :, h] @ W_O[h] + b_O``, zeroing ``z`` deletes the head's output ``z @ W_O[h]``
and keeps ``b_O``. :func:`head_ablation_hooks` returns ordinary ``(hook_name, fn)`` pairs, one per layer
touched, so they compose with other hooks and with ``transformer_lens.patching``.

The reference statistics live in :mod:`mechgeom.analyses.heads.stats`; the orders, the retention levels
and the critical-head flag (``ΔPPL > median + k * MAD``) in :mod:`mechgeom.analyses.heads.orders`; the loss
and the multiple-choice scoring in :mod:`mechgeom.analyses.scoring`. Their public names are re-exported.

**Speed.** Removing a head of layer ``l`` changes nothing before layer ``l``. :func:`single_head_sweep`
therefore runs the clean model block by block, keeps only the residual stream at the current layer's input
(``blocks.{l}.hook_resid_pre``) and runs each of layer ``l``'s ablations from there with
``model(resid, start_at_layer=l, tokens=..., return_type="loss")``; the result equals the full forward.
The heads of one layer run together, one copy of the batch per head (:mod:`mechgeom.analyses.heads.removal`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from mechgeom._progress import progress

# the statistics and the orders moved to their own modules; their public names are re-exported here
from mechgeom.analyses.base import Result
from mechgeom.analyses.heads.orders import (
    RETENTION_LEVELS,
    all_heads,
    compare_orders,
    mad_outliers,
    retention_levels,
    taxonomy_wins,
)
from mechgeom.analyses.heads.removal import COPIES_PER_BATCH, batched_head_nll, clean_resid, text_batches
from mechgeom.analyses.heads.stats import HeadStats
from mechgeom.analyses.scoring import encode_choices, prediction_targets, task_accuracy, text_nll, token_nll
from mechgeom.data import TaskItem
from mechgeom.hooks import (
    FwdHook,
    Head,
    TokensOrText,
    head_ablation_hooks,
    resolve_head_set,
    to_batch,
)
from mechgeom.hooks.interventions import HeadAblationMode as AblationMode
from mechgeom.models.adapter import adapter
from mechgeom.sweep import Executor, Item, RowStore, executor_for, model_label, run_sweep, tokens_hash
from mechgeom.typing import Float, Tensor, Tokens

__all__ = [
    "RetentionCurves",
    "SingleHeadResult",
    "retention_curve",
    "retention_curves",
    "single_head_sweep",
    "sweep_exactness",
]


# --------------------------------------------------------------------------- single-head sweep


_FRESH = "delete it or choose another checkpoint="


def _tokens_key(tokens: Tokens, mask: Tensor | None = None) -> str:
    """The tokens (and, where there is padding, the mask of real tokens) by content, for a fingerprint."""
    return f"{tuple(tokens.shape)}:{tokens_hash(tokens, attention_mask=mask)}"


def _corpus(
    model: Any, name: str, tokens_or_text: Any, attention_mask: Tensor | None
) -> tuple[Tokens, Tensor | None]:
    """A corpus as ``(tokens, mask)`` (:func:`~mechgeom.hooks.to_batch`: texts padded on the tokenizer's
    side, the mask ``None`` where nothing is padding); every text needs two real tokens."""
    return to_batch(
        model,
        tokens_or_text,
        attention_mask=attention_mask,
        min_pos=2,
        what=f"corpus {name!r} (a token to predict)",
    )


def _masked_head_nll(model: Any, mask: Tensor, tokens: Tokens, hooks: list[FwdHook]) -> Tensor:
    """Each row's mean NLL over its real predictions (``mask`` copied with the rows, as the tokens are)."""
    loss = token_nll(model, tokens, hooks, attention_mask=mask.bool())
    return loss.sum(-1) / prediction_targets(mask, *tokens.shape).sum(-1)


@dataclass
class _HeadWork:
    """The work of one item ``key = (layer, *heads)``: every text's NLL with each of those heads of
    ``layer`` removed alone (picklable), the heads run together in copies
    (:func:`~mechgeom.analyses.heads.removal.batched_head_nll`, at most ``COPIES_PER_BATCH * batch_size``
    sequences per forward).

    On the ``start_at_layer`` path the clean residual stream of every batch is cached per worker at the
    input of the last layer asked for and advanced block by block (restarted from the embeddings when an
    earlier layer is asked for)."""

    tokens: Tokens
    mode: AblationMode
    means: HeadStats | Tensor | None
    batch_size: int
    use_resid: bool
    mask: Tensor | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_cache": {}}

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        layer, heads = int(item.key[0]), [int(h) for h in item.key[1:]]
        hooks = [head_ablation_hooks(model, [(layer, h)], mode=self.mode, means=self.means)[0] for h in heads]
        n, max_seqs = self.tokens.shape[0], COPIES_PER_BATCH * self.batch_size
        if self.use_resid:
            toks, batches, inputs = clean_resid(self._cache, model, self.tokens, self.batch_size, layer)
            nll = batched_head_nll(
                hooks, inputs, toks, batches, lambda x, t, hk: _nll_from_layer(model, x, t, layer, hk),
                max_seqs=max_seqs,
            )  # fmt: skip
        elif (
            self.mask is not None
        ):  # padded texts: the mask is what each forward starts from, copied per head
            toks, mask = self.tokens.to(model.cfg.device), self.mask.to(model.cfg.device).long()
            batches = text_batches(n, self.batch_size)
            nll = batched_head_nll(
                hooks, [mask[sl] for sl in batches], toks, batches,
                lambda m, t, hk: _masked_head_nll(model, m, t, hk), max_seqs=max_seqs,
            )  # fmt: skip
        else:
            toks = self.tokens.to(model.cfg.device)
            batches = text_batches(n, self.batch_size)
            nll = batched_head_nll(
                hooks, [toks[sl] for sl in batches], toks, batches,
                lambda x, _t, hk: token_nll(model, x, hk).mean(dim=-1), max_seqs=max_seqs,
            )  # fmt: skip
        return pd.DataFrame(
            {
                "layer": layer,
                "head": np.repeat(np.asarray(heads, dtype=np.int64), n),
                "text": np.tile(np.arange(n), len(heads)),
                "nll": nll.flatten().double().numpy(),
            }
        )


def _nll_from_layer(
    model: Any,
    resid: Float[Tensor, "batch pos d_model"],
    tokens: Tokens,
    layer: int,
    fwd_hooks: Sequence[FwdHook],
) -> Float[Tensor, " batch"]:
    """Mean next-token NLL per text, running the model from ``resid`` = ``blocks.{layer}.hook_resid_pre``.

    The loss of :func:`mechgeom.analyses.scoring.token_nll` (as :func:`~mechgeom.analyses.scoring.text_nll`),
    mean over positions.
    """
    return token_nll(model, resid, fwd_hooks, start_at_layer=layer, tokens=tokens).mean(dim=-1)


@dataclass
class SingleHeadResult(Result):
    """Single-head ablation NLLs: ``nll[l, h, t]`` is text ``t``'s mean NLL with head ``(l, h)`` removed."""

    clean_nll: Float[Tensor, " text"]
    nll: Float[Tensor, "layer head_index text"]
    mode: str = "zero"

    @property
    def clean_ppl(self) -> float:
        return float(torch.exp(self.clean_nll.mean()))

    @property
    def ppl(self) -> Float[Tensor, "layer head_index"]:
        """``exp`` of the mean NLL over texts (equal-length windows), as :func:`mechgeom.analyses.scoring.perplexity`."""
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

    def summary(self, *, k: float = 5.0) -> dict[str, Any]:
        """Headline numbers of the leaderboard: ``clean_ppl``, ``mode``, ``k``, ``n_heads`` (swept),
        ``median_delta_ppl``, ``mad_scaled``, ``threshold`` (``median + k * MAD``), the most harmful head
        ``worst_head`` ``[l, h]`` with ``worst_delta_ppl`` (and as ``top``: ``layer, head, delta_ppl,
        ratio_to_median, robust_z``), ``top5`` and the ``critical``
        heads ``[[layer, head], ...]`` (most harmful first) with ``n_critical``."""
        board = self.to_frame(k=k)
        if board.empty:
            raise ValueError("the sweep holds no head; run single_head_sweep first")
        out = mad_outliers(board["delta_ppl"].to_numpy(), k=k)

        def head(r: dict[Any, Any]) -> dict[str, Any]:
            return {"layer": int(r["layer"]), "head": int(r["head"]), "delta_ppl": float(r["delta_ppl"])}

        rows: list[dict[Any, Any]] = board.head(5).to_dict("records")
        top = rows[0]
        crit = board[board["critical"]]
        return {
            "clean_ppl": self.clean_ppl,
            "mode": self.mode,
            "k": float(k),
            "n_heads": len(board),
            "median_delta_ppl": float(out["median"]),
            "mad_scaled": float(out["mad"]),
            "threshold": float(out["threshold"]),
            "worst_head": [int(top["layer"]), int(top["head"])],
            "worst_delta_ppl": float(top["delta_ppl"]),
            "top": {
                **head(top),
                "ratio_to_median": float(top["ratio_to_median"]),
                "robust_z": float(top["robust_z"]),
            },
            "top5": [{**head(r), "robust_z": float(r["robust_z"])} for r in rows],
            "critical": [[int(a), int(b)] for a, b in zip(crit["layer"], crit["head"], strict=True)],
            "n_critical": len(crit),
        }


def single_head_sweep(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    heads: Iterable[Head] | None = None,
    mode: AblationMode = "zero",
    means: HeadStats | Tensor | None = None,
    batch_size: int = 8,
    start_at_layer: bool = True,
    attention_mask: Tensor | None = None,
    checkpoint: str | Path | None = None,
    executor: Executor | None = None,
    verbose: bool = False,
) -> SingleHeadResult:
    """NLL of every text with each head removed alone (``heads=None``: all heads), plus the clean NLL.

    With ``start_at_layer`` (default) the clean residual stream is advanced block by block over all texts
    and each head of layer ``l`` is evaluated from ``blocks.{l}.hook_resid_pre`` (exact: earlier layers do
    not see the removal); otherwise from the tokens, full forwards (always so where the backend cannot
    resume at a layer: :attr:`~mechgeom.models.adapter.ModelAdapter.supports_start_at_layer`). Either way
    the heads of a layer share forwards, one copy of each text batch per head
    (:mod:`mechgeom.analyses.heads.removal`; at most ``2 * batch_size`` sequences per forward).
    ``checkpoint`` (a ``.csv``/``.parquet`` path) records each layer's rows as soon as its heads
    finish and resumes from them (:mod:`mechgeom.sweep`; heads already on file are not recomputed, a layer
    cut off mid-way is rerun); a file of another model (name, weights, dtype), tokens, mode or ``means`` is
    refused with a ``ValueError`` naming the difference. ``executor`` runs the layers elsewhere (e.g.
    :class:`mechgeom.sweep.RayExecutor`, each worker loading the same model by name and caching the
    residual stream). ``verbose`` progress counts layers.

    ``attention_mask`` (``[n_texts, pos]``, 1 at real tokens; for a list of texts the default pads them on
    the tokenizer's side, :func:`~mechgeom.hooks.to_batch`) runs every forward with the padding masked;
    each text's NLL is the mean over its own real predictions, as alone. A padded batch takes full forwards
    (not ``start_at_layer``). The mask is part of a checkpoint's fingerprint.
    """
    tokens, mask = to_batch(
        model, tokens_or_text, attention_mask=attention_mask, min_pos=2,
        what="the single-head sweep (a token to predict)",
    )  # fmt: skip
    n_layers, n_heads, n_texts = int(model.cfg.n_layers), int(model.cfg.n_heads), tokens.shape[0]
    wanted = resolve_head_set(model, all_heads(model) if heads is None else heads)
    head_ablation_hooks(model, [], mode=mode, means=means)  # checks mode and means before any work
    settings = {
        "model": model_label(model),
        "heads": f"{n_layers}x{n_heads}",
        "tokens": _tokens_key(tokens, mask),
        "mode": mode,
        "means": getattr(means, "z_mean", means) if mode == "mean" else None,  # by content
    }
    store = RowStore(
        checkpoint, key=["layer", "head", "text"], settings=settings, model=model, what="checkpoint",
        fresh=_FRESH,
    )  # fmt: skip
    items = []  # one per layer: the wanted heads not (fully) on file
    for layer, hs in wanted.items():
        todo = [h for h in hs if any((layer, h, t) not in store for t in range(n_texts))]
        rows = tuple((layer, h, t) for h in todo for t in range(n_texts))
        items += [Item(key=(layer, *todo), rows=rows, batch=layer)] if todo else []
    clean = text_nll(model, tokens, attention_mask=mask, batch_size=batch_size)
    # where the backend cannot resume at a layer (a bridge, shortformer positions), full forwards
    use_resid = start_at_layer and adapter(model).supports_start_at_layer and mask is None
    work = _HeadWork(tokens, mode, means, batch_size, use_resid, mask)
    run_sweep(
        items, work, store, executor=executor_for(model, executor), desc="single-head sweep", verbose=verbose
    )
    nll = torch.full((n_layers, n_heads, n_texts), float("nan"))
    done = store.frame
    for a, b, c, v in zip(*(done[k].to_numpy() for k in ("layer", "head", "text", "nll")), strict=True):
        nll[int(a), int(b), int(c)] = float(v)
    return SingleHeadResult(clean_nll=clean, nll=nll, mode=mode)


def sweep_exactness(
    model: Any,
    tokens: Tokens,
    sweep: SingleHeadResult,
    heads: int | Sequence[Head] = 3,
    *,
    means: HeadStats | Tensor | None = None,
    batch_size: int = 8,
    attention_mask: Tensor | None = None,
) -> dict[str, Any]:
    """Check a sweep against full forwards: ``max_abs_nll_gap = max |NLL(sweep) − NLL(text_nll)|`` over
    ``heads`` and texts (the sweep's mode; ``means`` and ``attention_mask`` as in the sweep).

    ``heads`` is a list of ``(layer, head)`` or a number ``n`` of the heads ``(0, 0)``,
    ``(n_layers // 2, 1)``, ``(n_layers - 1, n_heads - 1)``. Returns ``{"heads": [[l, h], ...],
    "max_abs_nll_gap": float | None}`` (``None`` for no head); 0 where ``start_at_layer`` is exact.
    """
    tokens, mask = to_batch(
        model, tokens, attention_mask=attention_mask, min_pos=2, what="the sweep check (a token to predict)"
    )
    if isinstance(heads, int):
        n_layers, n_heads = int(model.cfg.n_layers), int(model.cfg.n_heads)
        heads = [(0, 0), (n_layers // 2, min(1, n_heads - 1)), (n_layers - 1, n_heads - 1)][:heads]
    mode: AblationMode = "mean" if sweep.mode == "mean" else "zero"
    gaps = []
    for lh in heads:
        hooks = head_ablation_hooks(model, [lh], mode=mode, means=means)
        gaps.append(
            float(
                (text_nll(model, tokens, hooks, attention_mask=mask, batch_size=batch_size) - sweep.nll[lh])
                .abs()
                .max()
            )
        )
    return {"heads": [[int(a), int(b)] for a, b in heads], "max_abs_nll_gap": max(gaps) if gaps else None}


# --------------------------------------------------------------------------- retention curves


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


def _clean_scores(
    model: Any,
    corpora: Mapping[str, Tokens],
    masks: Mapping[str, Tensor | None],
    task: tuple[str, Sequence[TaskItem]] | None,
    encoded: Any,
    extra_hooks: Sequence[FwdHook],
    batch_size: int,
    clean: _Clean | None,
) -> _Clean:
    """The clean model's NLL per corpus (and task accuracy) with ``extra_hooks``: ``clean`` as given where it
    already holds them (a shared clean pass of :func:`retention_curves`), else computed into it."""
    if clean is None:
        clean = _Clean()
    if any(c not in clean.nll for c in corpora) or (task is not None and clean.accuracy is None):
        for corpus, toks in corpora.items():
            clean.nll[corpus] = float(
                text_nll(model, toks, extra_hooks, attention_mask=masks[corpus], batch_size=batch_size).mean()
            )
        if task is not None and encoded is not None:
            clean.accuracy = task_accuracy(
                model, task[1], extra_hooks, batch_size=batch_size, encoded=encoded
            )
    return clean


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
    attention_mask: Mapping[str, Tensor | None] | None = None,
    verbose: bool = False,
) -> pd.DataFrame:
    """PPL on each corpus (and accuracy on ``task = (task_name, items)``) as the heads of ``order`` are removed.

    Tidy rows: ``order, retention, n_heads_kept, n_heads_removed, corpus, nll, ppl, delta_ppl, accuracy,
    delta_accuracy`` — corpus rows have NaN accuracy, task rows (``corpus`` = task name) NaN PPL. Deltas are
    against the clean model with ``extra_hooks`` still attached.

    A corpus may be texts of different lengths: ``attention_mask`` maps a corpus name to its ``[n_texts,
    pos]`` mask (1 at real tokens); a list of texts without one is padded on the tokenizer's side
    (:func:`~mechgeom.hooks.to_batch`). Each text's NLL is then the mean over its own real predictions,
    as alone, and a corpus' NLL the mean over its texts.
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 57 lines.
    order = _check_order(model, order)
    masks_in = attention_mask or {}
    batches = {c: _corpus(model, c, t, masks_in.get(c)) for c, t in corpora.items()}
    corpora = {c: b[0] for c, b in batches.items()}
    masks = {c: b[1] for c, b in batches.items()}
    n_total = len(order)
    encoded = encode_choices(model, task[1]) if task is not None else None
    clean = _clean_scores(model, corpora, masks, task, encoded, extra_hooks, batch_size, clean)
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
                else float(
                    text_nll(model, toks, hooks, attention_mask=masks[corpus], batch_size=batch_size).mean()
                )
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
class RetentionCurves(Result):
    """Retention curves of several orders (one tidy frame) and the number of heads of the model."""

    frame: pd.DataFrame
    n_heads: int
    mode: str = "zero"

    def to_frame(self) -> pd.DataFrame:
        return self.frame.copy()

    def summary_frame(self) -> pd.DataFrame:
        """Per order and corpus/task: mean ``ΔPPL`` (or mean accuracy) over the retention levels below 100%."""
        df = self.frame[self.frame["retention"] < 1.0]
        return (
            df.groupby(["corpus", "order"], sort=False)
            .agg(mean_delta_ppl=("delta_ppl", "mean"), mean_accuracy=("accuracy", "mean"))
            .reset_index()
        )

    def comparison(self) -> pd.DataFrame:
        """Each order's PPL (accuracy) per corpus/task and retention < 100%, and the best order
        (:func:`~mechgeom.analyses.heads.orders.compare_orders`)."""
        return compare_orders(self.frame)

    def taxonomy_wins(self) -> dict[str, Any]:
        """Where the taxonomy order beats each baseline (:func:`~mechgeom.analyses.heads.orders.taxonomy_wins`)."""
        return taxonomy_wins(self.comparison())

    def summary(self) -> dict[str, Any]:
        """Headline numbers: ``n_heads``, ``mode``, ``orders``, ``levels``, ``mean_delta_ppl`` ``{order: mean
        ΔPPL over the levels below 100% and every corpus}``, ``by_corpus`` ``{corpus: {order: mean ΔPPL (a
        corpus) or mean accuracy (a task)}}`` and ``taxonomy_wins`` (:meth:`taxonomy_wins`)."""
        out: dict[str, Any] = {"n_heads": int(self.n_heads), "mode": self.mode}
        if self.frame.empty:
            return {
                **out,
                "orders": [],
                "levels": [],
                "mean_delta_ppl": {},
                "by_corpus": {},
                "taxonomy_wins": {},
            }
        below = self.frame[(self.frame["retention"] < 1.0) & self.frame["ppl"].notna()]
        by_corpus: dict[str, dict[str, float]] = {}
        for r in self.summary_frame().to_dict("records"):
            value = r["mean_accuracy"] if np.isnan(r["mean_delta_ppl"]) else r["mean_delta_ppl"]
            by_corpus.setdefault(str(r["corpus"]), {})[str(r["order"])] = float(value)
        return {
            **out,
            "orders": [str(o) for o in self.frame["order"].unique()],
            "levels": sorted({float(r) for r in self.frame["retention"]}, reverse=True),
            "mean_delta_ppl": {
                str(o): float(v) for o, v in below.groupby("order", sort=False)["delta_ppl"].mean().items()
            },
            "by_corpus": by_corpus,
            "taxonomy_wins": self.taxonomy_wins(),
        }


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
    executor: Executor | None = None,
    attention_mask: Mapping[str, Tensor | None] | None = None,
    verbose: bool = False,
) -> RetentionCurves:
    """:func:`retention_curve` for every order, the clean pass shared; resumable.

    ``checkpoint`` (``.csv``/``.parquet``) holds the rows of the orders already finished
    (:mod:`mechgeom.sweep`); they are read back, kept in the result (also orders not in ``orders``) and not
    recomputed; an order absent from it is run. The file is tied to the model (name, weights, dtype), the
    corpora (by token content), the levels, the mode and ``means``, and the task items: another run's file is
    refused with a ``ValueError`` naming each difference.
    ``on_order(frame_so_far)`` runs after each order; ``executor`` runs the orders elsewhere (as in
    :func:`single_head_sweep`). ``attention_mask`` maps corpus names to their masks (as in
    :func:`retention_curve`); the masks are part of the checkpoint's fingerprint.
    """
    n_total = int(model.cfg.n_layers) * int(model.cfg.n_heads)
    masks_in = attention_mask or {}
    batches = {c: _corpus(model, c, t, masks_in.get(c)) for c, t in corpora.items()}
    corpora = {c: b[0] for c, b in batches.items()}
    masks = {c: b[1] for c, b in batches.items()}
    levels_t = retention_levels(n_total, levels)
    names = [*corpora, *([task[0]] if task is not None else [])]
    settings = {
        "model": model_label(model),
        "heads": f"{model.cfg.n_layers}x{model.cfg.n_heads}",
        "corpora": ";".join(f"{c}={_tokens_key(t, masks[c])}" for c, t in corpora.items()),
        "levels": ",".join(str(round(r, 10)) for r, _ in levels_t),
        "mode": mode,
        "means": getattr(means, "z_mean", means) if mode == "mean" else None,  # by content
        "task": "none" if task is None else f"{task[0]}={_items_key(task[1])}",
    }
    store = RowStore(
        checkpoint, key=["order", "retention", "corpus"], settings=settings, model=model, what="checkpoint",
        fresh=_FRESH,
    )  # fmt: skip
    items = [
        Item(key=(name,), rows=tuple((name, r, c) for r, _ in levels_t for c in names), data=list(order))
        for name, order in orders.items()
    ]
    work = _RetentionWork(corpora, tuple(levels), mode, means, task, batch_size, verbose, masks)
    after = None if on_order is None else (lambda _item, _rows: on_order(store.rows()))
    run_sweep(
        items,
        work,
        store,
        executor=executor_for(model, executor),
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
    masks: dict[str, Tensor | None] = field(default_factory=dict)
    _clean: _Clean = field(default_factory=_Clean, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_clean": _Clean()}

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        return retention_curve(
            model, item.data, self.corpora, name=item.key[0], levels=self.levels, mode=self.mode,
            means=self.means, task=self.task, batch_size=self.batch_size, clean=self._clean,
            attention_mask=self.masks, verbose=self.verbose,
        )  # fmt: skip
