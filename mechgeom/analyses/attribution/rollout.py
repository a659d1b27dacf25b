"""Attention rollout (Abnar and Zuidema, 2020; ``docs/definitions.md``, attention rollout).

Each layer mixes its residual stream through attention and passes it on through the skip connection. Rollout
models both as one row-stochastic matrix per layer and multiplies them from the input up:

- ``Ã_l = 0.5 * mean_h alpha_l + 0.5 * I``, each row renormalised to sum to 1;
- ``R_l = Ã_l R_{l-1}``, with ``R_{-1} = I``.

``R_{l-1}[i, j]`` is then the share of input token ``j`` in the residual stream that layer ``l`` reads at
position ``i``: the score of source ``j`` for query ``i`` at layer ``l``. It is one score per layer, the same
for every head of the layer (a layer-level method). At layer 0 it is the identity: each position holds only
its own token.

Conventions: GQA does not matter (only ``hook_pattern`` is read). Rollout reads the patterns the model computed,
so an intervention on ``hook_pattern`` changes it, and one on ``hook_z`` changes it only through the later
layers' patterns: rollout models a layer's output as a mix of its inputs, which a changed ``z`` no longer is, so
the heads whose ``z`` an earlier hook changed are listed in :attr:`RolloutResult.modified_heads`. On an encoder, padding (keys no query attends
to) gets no share and its rows are 0. The products are taken in float32 (float64 for a float64 model), whatever
the activations' dtype, so rows sum to 1 to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Unpack

import pandas as pd
import torch

from mechgeom.analyses.base import Collector, PassOptions, Result, entry_point, run_collector
from mechgeom.hooks import (
    LayerActivations,
    TokensOrText,
    check_indices,
    modified_pairs,
    resolve_layers,
    token_strings,
)
from mechgeom.typing import Bool, Float, Pattern, Tensor, Tokens

__all__ = ["RolloutCollector", "RolloutResult", "attention_rollout", "rollout_step"]


def rollout_step(
    pattern: Pattern, previous: Float[Tensor, "batch query_pos key_pos"] | None
) -> Float[Tensor, "batch query_pos key_pos"]:
    """One layer of rollout: ``R_l = norm_rows(0.5 * mean_h alpha_l + 0.5 * I) @ R_{l-1}``.

    Args:
        pattern: ``hook_pattern`` of layer ``l``, ``[batch, head, q, k]`` with ``q == k``.
        previous: ``R_{l-1}``; ``None`` is the identity ``R_{-1}``.

    Returns:
        ``R_l`` in float32 (float64 for a float64 pattern). A row whose mixed attention is all zero (a padding
        query of an encoder) stays the identity row.

    >>> p = torch.tensor([[[[1.0, 0.0], [0.5, 0.5]]]])  # one head
    >>> rollout_step(p, None)[0].tolist()
    [[1.0, 0.0], [0.25, 0.75]]
    """
    dtype = torch.float64 if pattern.dtype == torch.float64 else torch.float32
    mixed = pattern.to(dtype).mean(dim=1)  # [b q k]
    eye = torch.eye(mixed.shape[-1], dtype=dtype, device=mixed.device)
    a = 0.5 * mixed + 0.5 * eye
    a = a / a.sum(dim=-1, keepdim=True)
    return a if previous is None else a @ previous.to(dtype)


@dataclass
class RolloutResult(Result):
    """Rollout scores ``[batch, layer, query_pos, key_pos]``: ``scores[b, k, i, j] = R_{l-1}[i, j]`` for
    ``l = layers[k]``, the share of input token ``j`` in the residual that layer ``l`` reads at position ``i``.

    Rows sum to 1 (padding rows of an encoder are 0). ``modified[b, l, h]`` marks, for each layer ``l`` read (0 to
    ``max(layers)``), the heads whose ``z`` an earlier hook changed (see the module docstring).
    """

    layers: list[int]
    scores: Float[Tensor, "batch layer query_pos key_pos"]
    tokens: Tokens | None = None
    str_tokens: list[list[str]] | None = None
    model_name: str = ""
    causal: bool = True
    modified: Bool[Tensor, "batch layer head_index"] | None = None
    #: An encoder's real (non-padding) tokens ``[batch, pos]``; ``None`` without padding.
    key_mask: Bool[Tensor, "batch pos"] | None = None

    @property
    def modified_heads(self) -> list[tuple[int, int]]:
        """``(layer, head)`` pairs of the layers read whose ``z`` an earlier hook changed."""
        if self.modified is None:
            return []
        return modified_pairs(self.modified[..., None], list(range(self.modified.shape[1])))

    def to_frame(self, *, batch: int | Sequence[int] | None = None) -> pd.DataFrame:
        """One row per (text, layer, query, source): ``batch, layer, query, key, rollout`` (and the tokens),
        sources ``key <= query`` on a decoder, every pair of real tokens on an encoder; every text by default."""
        n, _, q, k = self.scores.shape
        frames = []
        for b in check_indices(batch, n, "batch"):
            qq, kk = (
                torch.tril_indices(q, k) if self.causal else torch.cartesian_prod(*(torch.arange(q),) * 2).T
            )
            start = 0
            if self.key_mask is not None:
                real = self.key_mask[b]
                keep = real[qq] & real[kk]
                qq, kk = qq[keep], kk[keep]
                start = int(real.long().argmax())  # left padding: positions inside the text
            for li, layer in enumerate(self.layers):
                vals = self.scores[b, li, qq, kk]
                cols: dict[str, Any] = {
                    "batch": b,
                    "layer": layer,
                    "query": (qq - start).numpy(),
                    "key": (kk - start).numpy(),
                }
                if self.str_tokens is not None:
                    cols["query_token"] = [self.str_tokens[b][i] for i in qq.tolist()]
                    cols["key_token"] = [self.str_tokens[b][j] for j in kk.tolist()]
                cols["rollout"] = vals.numpy()
                frames.append(pd.DataFrame(cols))
        return pd.concat(frames, ignore_index=True)

    def summary(self) -> dict[str, Any]:
        """Per analysed layer, the mean share of the first position (``first_token_share``, over queries
        ``i >= 1``) and of each position's own token (``self_share``), over texts. With padding the first
        position is each text's first real token, and only real queries are averaged (their pooled mean)."""
        s = self.scores.double()
        n, _, q, _ = s.shape
        real = torch.ones(n, q, dtype=torch.bool) if self.key_mask is None else self.key_mask.cpu().bool()
        starts = real.long().argmax(-1)  # [n]: each text's first real token
        first_col = s[torch.arange(n), :, :, starts]  # [n layer q]: the share of that token
        after = real & (torch.arange(q)[None, :] > starts[:, None])  # real queries after it
        den = after.sum()
        first = (
            (first_col * after[:, None, :]).sum(dim=(0, 2)) / den
            if int(den)
            else torch.full((len(self.layers),), torch.nan)
        )
        diag = torch.diagonal(s, dim1=-2, dim2=-1)  # [n layer q]
        own = (diag * real[:, None, :]).sum(dim=(0, 2)) / real.sum()
        return {
            "n_texts": int(s.shape[0]),
            "layers": list(self.layers),
            "first_token_share": [float(x) for x in first],
            "self_share": [float(x) for x in own],
        }


class RolloutCollector(Collector):
    """Reads ``hook_pattern`` of every layer below the deepest of ``layers`` and keeps ``R_{l-1}`` for each.

    Args:
        model: a decoder or an encoder.
        layers: the layers whose input is scored (default every layer); the reader covers layers 0 to
            ``max(layers)``, whose patterns the products need.
        on_scores: ``on_scores(layer, scores)`` receives each scored layer's ``[batch, q, k]`` scores as soon
            as they are known, and nothing is kept (no :meth:`result`); a ranking method streams them so.
    """

    supports_encoders = True

    def __init__(
        self,
        model: Any,
        layers: int | Sequence[int] | None = None,
        *,
        on_scores: Callable[[int, Tensor], None] | None = None,
    ) -> None:
        self.on_scores = on_scores
        self.scored = resolve_layers(model, layers)
        super().__init__(model, list(range(max(self.scored) + 1)))
        self._current: Tensor | None = None  # R of the last layer read in this pass
        self._kept: dict[int, list[Tensor]] = {layer: [] for layer in self.scored}
        self._modified: dict[int, list[Tensor]] = {layer: [] for layer in self.layers}  # [b head] per pass
        self._masks: list[Tensor] = []  # [b pos] real tokens, per pass

    def on_layer(self, acts: LayerActivations) -> None:
        pattern = acts.pattern
        if acts.layer == 0:
            self._current = None
            real = acts.key_mask
            self._masks.append(
                torch.ones(pattern.shape[0], pattern.shape[-1], dtype=torch.bool)
                if real is None
                else real.cpu()
            )
            b, q = pattern.shape[0], pattern.shape[-1]
            eye = torch.eye(
                q,
                dtype=torch.float64 if pattern.dtype == torch.float64 else torch.float32,
                device=pattern.device,  # R of layer 0, streamed to on_scores like the later layers' R
            )
            identity = eye.expand(b, q, q)
        if acts.layer in self.scored:
            r = identity if acts.layer == 0 else self._current
            assert r is not None
            if self.on_scores is not None:
                self.on_scores(acts.layer, self._mask_padding(r, acts))
            else:
                self._kept[acts.layer].append(self._mask_padding(r.cpu(), acts))
        if acts.layer < max(self.scored):
            with torch.no_grad():
                self._current = rollout_step(pattern, self._current)
        mod = acts.modified
        self._modified[acts.layer].append(
            torch.zeros(pattern.shape[:2], dtype=torch.bool) if mod is None else mod.any(dim=2).cpu()
        )

    @staticmethod
    def _mask_padding(r: Tensor, acts: LayerActivations) -> Tensor:
        if acts.key_mask is None:
            return r
        real = acts.key_mask.to(r.device)
        return r * (real[:, :, None] & real[:, None, :])

    def build(self, tokens: Tokens | None) -> RolloutResult:
        if self.on_scores is not None:
            raise RuntimeError(
                "this collector streams each layer's scores to its on_scores callback and keeps none: collect "
                "them there, or make the collector without on_scores to get a result"
            )
        return RolloutResult(
            layers=list(self.scored),
            scores=torch.stack([torch.cat(self._kept[la]) for la in self.scored], dim=1),
            tokens=tokens,
            str_tokens=token_strings(self.model, tokens),
            model_name=self.model_name,
            causal=self.causal,
            modified=torch.stack([torch.cat(self._modified[la]) for la in self.layers], dim=1),
            key_mask=None if all(bool(m.all()) for m in self._masks) else torch.cat(self._masks),
        )


@entry_point
def attention_rollout(
    model: Any,
    tokens_or_text: TokensOrText | None,
    *,
    layers: int | Sequence[int] | None = None,
    batch_size: int = 8,
    **run: Unpack[PassOptions],
) -> RolloutResult:
    """Attention rollout scores of the input to each of ``layers`` (default every layer).

    Args:
        model: a decoder or an encoder.
        tokens_or_text: text, texts or token ids (the cached texts with ``cache``, optional there).
        layers: the layers whose input is scored; an int or a sequence of ints.
        cache: an ``ActivationCache`` holding ``hook_pattern``, ``hook_v`` and ``hook_z`` of layers 0 to
            ``max(layers)``; nothing is run.
        extra_hooks: interventions run in the same passes, before the readers (a pattern edit changes
            rollout; a ``hook_z`` edit does not, and is marked in :attr:`RolloutResult.modified`).
        batch_size: texts per forward pass.
        attention_mask: ``[batch, pos]``, 1 at real tokens, 0 at padding (left or right); by default the
            padding of a list of texts or an encoder's ``[PAD]``. Padding is neither a query nor a source
            (0 in ``scores``, absent from :meth:`RolloutResult.to_frame`, whose positions are inside each text).

    Returns:
        A :class:`RolloutResult`.
    """
    col = RolloutCollector(model, layers)
    return run_collector(model, tokens_or_text, col, batch_size=batch_size, desc="rollout", **run)  # type: ignore[no-any-return]
