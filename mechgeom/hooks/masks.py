"""Position sets shared by the analyses and the interventions: the sink set ``S``, the queries after it, masks.

>>> sink_mask([0], 3).tolist(), query_mask([0], 3).tolist()
([True, False, False], [False, True, True])
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Sequence
from typing import Any

import torch

from mechgeom.hooks.validation import Queries, select_queries
from mechgeom.typing import Bool, Int, Tensor

__all__ = [
    "AlignedTexts",
    "SinkPositionError",
    "align_texts",
    "batch_queries",
    "check_sink_positions",
    "check_sinks_in_texts",
    "masked_mean",
    "query_mask",
    "resolve_sinks",
    "sink_mask",
    "sink_positions_per_text",
    "text_spans",
    "texts_first",
]


class SinkPositionError(IndexError, ValueError):
    """A sink position outside the sequence (an ``IndexError`` and, for older callers, a ``ValueError``)."""


def check_sink_positions(
    sink_positions: int | Sequence[int] | None, pos: int | None = None
) -> tuple[int, ...]:
    """The one sink-set validation, positions in the order given; ``None`` means ``(0,)``.

    Raises ``ValueError`` for an empty set or duplicates, and :class:`SinkPositionError` for a negative
    position or (when ``pos`` is given) one at or beyond the sequence length.

    >>> check_sink_positions([2, 0], pos=5)
    (2, 0)
    >>> check_sink_positions(5, pos=5)
    Traceback (most recent call last):
    ...
    mechgeom.hooks.masks.SinkPositionError: sink position(s) [5] beyond the sequence (length 5, positions 0..4)
    """
    if sink_positions is None:
        return (0,)
    named = isinstance(sink_positions, str) or (
        isinstance(sink_positions, Sequence) and any(isinstance(s, str) for s in sink_positions)
    )
    if named:
        raise ValueError(
            f"sink names in {sink_positions!r} are resolved per text by sink_statistics (on an encoder); "
            "give positions here"
        )
    out: tuple[int, ...]
    if isinstance(sink_positions, int) or hasattr(sink_positions, "__index__"):
        out = (operator.index(sink_positions),)  # type: ignore[arg-type]
    else:
        out = tuple(operator.index(s) for s in sink_positions)
    if not out:
        raise ValueError("sink_positions is empty; give at least one position (default [0])")
    if any(s < 0 for s in out):
        raise SinkPositionError(f"sink positions must be non-negative, got {list(out)}")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate sink positions in {list(out)}")
    if pos is not None and max(out) >= pos:
        bad = [s for s in out if s >= pos]
        raise SinkPositionError(
            f"sink position(s) {bad} beyond the sequence (length {pos}, positions 0..{pos - 1})"
        )
    return out


def check_sinks_in_texts(sinks: Sequence[int], lengths: Sequence[int], offset: int = 0) -> None:
    """Every text holds the sink set: ``max(S) < length`` of each text (positions inside each text).

    >>> check_sinks_in_texts([0, 2], [5, 3])
    >>> check_sinks_in_texts([0, 2], [5, 2])
    Traceback (most recent call last):
    ...
    mechgeom.hooks.masks.SinkPositionError: text 1 has 2 real token(s), so sink position(s) [0, 2] (positions inside each text, 0..1) lie beyond it: give sinks inside the shortest text or leave it out

    Raises:
        SinkPositionError: a text too short for ``S``, naming it (``offset`` + its index), its valid
            positions and the way out.
    """
    for b, n in enumerate(int(n) for n in lengths):
        if n <= max(sinks):
            raise SinkPositionError(
                f"text {offset + b} has {n} real token(s), so sink position(s) {list(sinks)} (positions inside "
                f"each text, 0..{n - 1}) lie beyond it: give sinks inside the shortest text or leave it out"
            )


def resolve_sinks(sink_positions: int | Sequence[int] | None, pos: int | None = None) -> list[int]:
    """The sorted sink set ``S`` (:func:`check_sink_positions`); ``None`` means ``[0]``.

    >>> resolve_sinks(None), resolve_sinks([2, 0])
    ([0], [0, 2])
    """
    return sorted(check_sink_positions(sink_positions, pos))


def sink_mask(sinks: Sequence[int], pos: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[pos]`` bool, True on the sink set."""
    mask = torch.zeros(pos, dtype=torch.bool, device=device)
    mask[list(sinks)] = True
    return mask


def query_mask(
    sinks: Sequence[int], pos: int, device: torch.device | str = "cpu", *, causal: bool = True
) -> torch.Tensor:
    """``[pos]`` bool, True on ``Q = {i : i > max(S)}``: the queries that see every sink and a non-sink.

    On an encoder (``causal=False``) every query sees every position, so ``Q`` is every position.

    >>> query_mask([0, 3], 4, causal=False).tolist()
    [True, True, True, True]
    """
    if not causal:
        return torch.ones(pos, dtype=torch.bool, device=device)
    return torch.arange(pos, device=device) > max(sinks)


def sink_positions_per_text(
    model: Any,
    tokens: Tensor,
    sink_positions: int | str | Sequence[int | str] | None,
    lengths: Sequence[int] | None = None,
) -> list[list[int]]:
    """The sink set of each text: positions as given, and special tokens named (``"[CLS]"``, ``"[SEP]"``)
    resolved in each text to the one position where that token stands.

    A name must be a single token of the model's tokenizer and occur exactly once in each text (its first
    ``lengths[b]`` tokens; default: all), else ``ValueError`` naming the text; a position must lie in the
    text. Positions come back sorted, as :func:`resolve_sinks` gives.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(convert_tokens_to_ids=lambda t: {"[CLS]": 1, "[SEP]": 2}.get(t, 0), unk_token_id=0)
    >>> m = SimpleNamespace(tokenizer=tok)
    >>> sink_positions_per_text(m, torch.tensor([[1, 7, 2, 0], [1, 7, 8, 2]]), ["[CLS]", "[SEP]"])
    [[0, 2], [0, 3]]
    """
    given = [sink_positions] if isinstance(sink_positions, int | str) else sink_positions
    names = [s for s in (given or []) if isinstance(s, str)]
    n_texts = int(tokens.shape[0])
    sizes = [int(tokens.shape[1])] * n_texts if lengths is None else [int(n) for n in lengths]
    if not names:
        return [resolve_sinks(sink_positions, n) for n in sizes]  # type: ignore[arg-type]
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        raise ValueError(f"sink names {names} need the model's tokenizer; this model has none")
    ids = {}
    for name in names:
        tid = tok.convert_tokens_to_ids(name)
        if tid is None or (
            tid == getattr(tok, "unk_token_id", None) and name != getattr(tok, "unk_token", None)
        ):
            raise ValueError(f"sink name {name!r} is not a token of the model's tokenizer")
        ids[name] = int(tid)
    out = []
    for b in range(n_texts):
        row: list[int] = []
        for s in given:  # type: ignore[union-attr]
            if isinstance(s, str):
                where = (tokens[b, : sizes[b]] == ids[s]).nonzero().flatten().tolist()
                if len(where) != 1:
                    raise ValueError(
                        f"sink name {s!r} occurs {len(where)} times in text {b}; it must occur exactly once"
                    )
                row.append(int(where[0]))
            else:
                row.append(operator.index(s))
        out.append(resolve_sinks(row, sizes[b]))
    return out


def masked_mean(x: Tensor, mask: Tensor, dim: int) -> Tensor:
    """Mean of ``x`` over ``mask`` along ``dim`` (NaN entries skipped); NaN where nothing is left."""
    keep = mask & ~torch.isnan(x)
    num = torch.where(keep, x, torch.zeros_like(x)).sum(dim)
    den = keep.sum(dim)
    return torch.where(den > 0, num / den.clamp_min(1), torch.full_like(num, float("nan")))


def text_spans(
    mask: Bool[Tensor, "batch pos"] | None, batch: int, pos: int
) -> tuple[Int[Tensor, " batch"], Int[Tensor, " batch"]]:
    """Where each text's real tokens stand in a padded batch: ``(start, length)`` per text (CPU).

    Padding is on the left or the right of a text (what a tokenizer and :func:`mechgeom.hooks.to_batch` make),
    so the real tokens are one block ``start .. start + length - 1``; ``mask=None`` is every position real.

    Raises:
        ValueError: a text whose real tokens are not one block (padding inside a text), naming it.

    >>> text_spans(torch.tensor([[False, True, True], [True, True, False]]), 2, 3)
    (tensor([1, 0]), tensor([2, 2]))
    """
    if mask is None:
        return torch.zeros(batch, dtype=torch.long), torch.full((batch,), pos, dtype=torch.long)
    m = mask.detach().cpu().bool()
    lengths = m.sum(-1)
    starts = m.long().argmax(-1)
    ar = torch.arange(pos)
    block = (ar[None, :] >= starts[:, None]) & (ar[None, :] < (starts + lengths)[:, None])
    bad = (block != m).any(-1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"text(s) {bad} have padding between real tokens: pad on the left or the right of each text "
            "(attention_mask 0 only at the start or the end of a row)"
        )
    return starts, lengths


@dataclasses.dataclass
class AlignedTexts:
    """One layer's activations with every text moved to the start of its row (see :func:`align_texts`).

    ``acts`` holds ``pattern``, ``v``, ``z`` and ``modified`` with text ``b``'s real tokens at positions
    ``0 .. lengths[b] - 1`` (padding after them); ``real`` is ``[batch, pos]``, True at those positions;
    ``keep`` (``[batch, pos]``) the kept queries in the same coordinates (every real one by default).
    """

    acts: Any
    lengths: Int[Tensor, " batch"]
    real: Bool[Tensor, "batch pos"]
    keep: Bool[Tensor, "batch pos"]


def batch_queries(
    queries: Queries, mask: Bool[Tensor, "batch pos"] | None, batch: int, pos: int, offset: int = 0
) -> Bool[Tensor, "batch pos"]:
    """The kept queries of one batch of a run (:func:`mechgeom.hooks.select_queries`, the one definition).

    Args:
        queries: what ``queries=`` of an analysis took. A boolean ``[n_texts, pos]`` mask over the whole input
            is sliced to this batch's rows ``offset .. offset + batch - 1`` (collectors see the texts batch
            after batch); every other form (positions inside each text, a slice, a ``[pos]`` mask) is the same
            for every batch.
        mask: this batch's real tokens (``None``: all real).
        batch, pos: this batch's shape.
        offset: the index of this batch's first text in the run.

    Returns:
        ``[batch, pos]`` bool over the padded batch (CPU); all False where a per-text mask keeps nothing of
        this batch (other batches hold the kept queries).

    Raises:
        As :func:`mechgeom.hooks.select_queries`; ``ValueError`` for a mask with fewer rows than texts.
    """
    if isinstance(queries, Tensor) and queries.ndim == 2 and queries.shape[0] != batch:
        if offset + batch > queries.shape[0]:
            raise ValueError(
                f"the queries mask has {queries.shape[0]} rows, but text {offset + batch - 1} was analysed: "
                "give one row per text"
            )
        queries = queries[offset : offset + batch]
    if isinstance(queries, Tensor) and queries.dtype == torch.bool and not bool(queries.any()):
        return torch.zeros(batch, pos, dtype=torch.bool)  # none of this batch's queries (others elsewhere)
    return select_queries(queries, mask, batch, pos)


def align_texts(acts: Any, queries: Queries = None, offset: int = 0) -> AlignedTexts:
    """A layer's activations (:class:`~mechgeom.hooks.LayerActivations`) with each text moved to the start.

    Left padding puts text ``b``'s first real token at ``start[b] > 0``; here its tokens move to ``0 ..
    length[b] - 1`` (a cyclic shift of the query and key axes of ``pattern`` and of ``v``, ``z``,
    ``modified``), so that position ``p`` is the ``p``-th token of every text, as when the text runs alone.
    On a causal decoder a real query then sees only real keys (the padding after it is in its future), so
    every per-query quantity of a real query equals that of the text run alone; the caller leaves out the
    queries at ``~real`` (padding) and the keys at ``~real``. Right padding (and no padding) is unchanged.

    Args:
        acts: one layer's activations; ``acts.key_mask`` marks the padding (``None``: none).
        queries: the kept queries (``queries=`` of the analyses, :func:`batch_queries`), ``None`` for all.
        offset: the index of this batch's first text in the run (for a ``[n_texts, pos]`` queries mask).

    Returns:
        An :class:`AlignedTexts`.
    """
    batch, pos = int(acts.pattern.shape[0]), int(acts.pattern.shape[-1])
    mask = acts.key_mask
    keep = batch_queries(queries, mask, batch, pos, offset)
    starts, lengths = text_spans(mask, batch, pos)
    real = torch.arange(pos)[None, :] < lengths[:, None]
    if not bool(starts.any()):
        return AlignedTexts(acts, lengths, real, keep)
    index = (torch.arange(pos)[None, :] + starts[:, None]) % pos  # [b p]: padded position of text position p
    keep = torch.gather(keep, 1, index)
    dev = acts.pattern.device
    idx = index.to(dev)
    b_ix = torch.arange(batch, device=dev)[:, None]
    pattern = acts.pattern[b_ix[:, :, None], :, idx[:, :, None], idx[:, None, :]]  # [b q k h]
    moved = dataclasses.replace(
        acts,
        pattern=pattern.permute(0, 3, 1, 2),
        v=acts.v[b_ix, idx],
        z=acts.z[b_ix, idx],
        modified=None
        if acts.modified is None
        else torch.gather(acts.modified, 2, idx[:, None, :].expand_as(acts.modified)),
        key_mask=real.to(dev),
    )
    return AlignedTexts(moved, lengths, real, keep)


def texts_first(tokens: Tensor | None, starts: Sequence[Tensor]) -> Tensor | None:
    """``tokens`` (``[n_texts, pos]``) with each text moved to the start of its row, as :func:`align_texts`
    moves the activations; ``starts`` are the first real positions of each batch's texts, in order. Unchanged
    without left padding (or without tokens, or when they do not match the starts).

    >>> texts_first(torch.tensor([[0, 0, 5, 6], [7, 8, 9, 1]]), [torch.tensor([2, 0])]).tolist()
    [[5, 6, 0, 0], [7, 8, 9, 1]]
    """
    if tokens is None or not starts:
        return tokens
    first = torch.cat(list(starts)).cpu()
    if first.shape[0] != tokens.shape[0] or not bool(first.any()):
        return tokens
    width = tokens.shape[-1]
    index = (torch.arange(width)[None, :] + first[:, None]) % width
    return torch.gather(tokens, 1, index.to(tokens.device))
