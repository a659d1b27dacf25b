"""Input validation shared by every entry point: the one token validator and the index filters.

Layers, heads and positions are checked with errors that name the valid range; :func:`to_tokens` turns
text or ids into a ``[batch, pos]`` tensor and refuses bad dtypes, ids out of range, empty or over-long
input. :func:`padding_mask` gives an encoder's ``[batch, pos]`` mask of real (non-padding) tokens.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from mechgeom.models.adapter import adapter
from mechgeom.typing import Bool, Tensor, Tokens

__all__ = [
    "Queries",
    "TokensOrText",
    "check_attention_mask",
    "check_decoder",
    "check_index",
    "check_indices",
    "check_text_position",
    "is_bidirectional",
    "pad_texts",
    "padding_mask",
    "padding_side",
    "resolve_heads",
    "resolve_layers",
    "right_align",
    "select_queries",
    "text_positions",
    "to_batch",
    "to_tokens",
    "token_strings",
]


def _n_layers(model: Any) -> int:
    return int(model.cfg.n_layers)


def _index_list(values: Any, what: str, plural: str) -> list[int]:
    """An int or a sequence of ints as a list; strings, bools and floats are a ``TypeError`` (``"12"`` would
    otherwise read as layers 1 and 2, and ``True`` as layer 1)."""

    def bad(x: Any) -> bool:
        return isinstance(x, bool | str | bytes | float) or not hasattr(x, "__index__")

    if isinstance(values, str | bytes) or (not isinstance(values, Sequence | Tensor) and bad(values)):
        raise TypeError(
            f"{plural} takes an int or a sequence of ints, got {type(values).__name__} {values!r}: "
            f"e.g. {plural}=12 or {plural}=[1, 2] (None for every {what})"
        )
    if isinstance(values, Tensor):
        if values.dtype.is_floating_point or values.dtype == torch.bool or values.ndim > 1:
            raise TypeError(
                f"{plural} takes integer indices, got a {values.dtype} tensor of shape {tuple(values.shape)}"
            )
        values = values.tolist() if values.ndim else int(values)
    if not isinstance(values, Sequence):
        return [operator.index(values)]
    wrong = [x for x in values if bad(x)]
    if wrong:
        raise TypeError(
            f"{plural} must hold ints, got {wrong[0]!r} ({type(wrong[0]).__name__}) in {list(values)!r}"
        )
    return [operator.index(x) for x in values]


def _resolve(values: Any, n: int, what: str, plural: str, has: str) -> list[int]:
    """``None`` -> ``range(n)``; else :func:`_index_list`, each in ``0..n-1``, no duplicates, not empty."""
    if values is None:
        return list(range(n))
    out = _index_list(values, what, plural)
    if not out:
        raise ValueError(f"{plural} is empty; pass None for every {what}")
    bad = [x for x in out if not 0 <= x < n]
    if bad:
        raise IndexError(f"{what}(s) {bad} out of range: the model has {n} {has} (0..{n - 1})")
    if len(set(out)) != len(out):
        raise ValueError(f"duplicate {plural} in {out}")
    return out


def resolve_layers(model: Any, layers: int | Sequence[int] | None) -> list[int]:
    """``None`` means every layer; an int or a sequence of ints is checked against ``n_layers``.

    Raises:
        TypeError: a string, bool or float (``"12"`` is not layers 1 and 2; ``True`` is not layer 1).
        IndexError: a layer out of range, naming the valid range.
        ValueError: duplicates or an empty list.

    >>> from types import SimpleNamespace
    >>> resolve_layers(SimpleNamespace(cfg=SimpleNamespace(n_layers=30)), "12")
    Traceback (most recent call last):
    ...
    TypeError: layers takes an int or a sequence of ints, got str '12': e.g. layers=12 or layers=[1, 2] (None for every layer)
    """
    return _resolve(layers, _n_layers(model), "layer", "layers", "layers")


def resolve_heads(model: Any, heads: int | Sequence[int] | None) -> list[int]:
    """``None`` means every head; otherwise checked against ``n_heads`` like :func:`resolve_layers`."""
    return _resolve(heads, int(model.cfg.n_heads), "head", "heads", "heads per layer")


def check_index(value: Any, size: int, what: str) -> int:
    """One index into an axis of ``size``: ints, numpy integers and 0-d integer tensors; no negatives.

    >>> check_index(8, 9, "head")
    8
    >>> check_index(-1, 9, "head")
    Traceback (most recent call last):
    ...
    IndexError: head -1 out of range (0..8)
    """
    try:
        index = operator.index(value)
    except TypeError:
        raise IndexError(f"{what} {value!r} is not an integer index") from None
    if not 0 <= index < size:
        raise IndexError(f"{what} {value!r} out of range (0..{size - 1})")
    return index


def check_indices(values: Any, size: int, what: str) -> list[int]:
    """A filter of indices (``None`` = all, an int, or a sequence), each checked by :func:`check_index`."""
    if values is None:
        return list(range(size))
    if isinstance(values, int | Tensor) or hasattr(values, "__index__"):
        return [check_index(values, size, what)]
    return [check_index(x, size, what) for x in values]


def is_bidirectional(model: Any) -> bool:
    """Whether ``model`` attends both ways (an encoder: BERT, ``attention_dir="bidirectional"``, or a
    ``HookedEncoder``), as its backend adapter says (:mod:`mechgeom.models.adapter`).

    >>> from types import SimpleNamespace
    >>> is_bidirectional(SimpleNamespace(cfg=SimpleNamespace(attention_dir="bidirectional")))
    True
    """
    return adapter(model).is_encoder


def check_decoder(model: Any, what: str = "this analysis") -> None:
    """Raise ``TypeError`` for an encoder (BERT-style) model where ``what`` supports causal decoders only."""
    if is_bidirectional(model):
        raise TypeError(
            f"{type(model).__name__} is not a causal decoder (attention_dir="
            f"{getattr(model.cfg, 'attention_dir', None)!r}); {what} supports causal decoders only "
            "(on an encoder: contribution weights, sinks and embedding faithfulness)"
        )


def check_attention_mask(mask: Any, tokens: Tokens) -> None:
    """Check an ``attention_mask`` against ``tokens``: ``[batch, pos]`` like them, of bools or 0/1 integers.

    Raises:
        TypeError: not a tensor, or a float tensor other than 0/1.
        ValueError: another shape (named beside the tokens'), or values other than 0 and 1.

    >>> check_attention_mask(torch.ones(2, 5), torch.zeros(2, 6, dtype=torch.long))
    Traceback (most recent call last):
    ...
    ValueError: attention_mask has shape (2, 5), but the tokens are (2, 6): give one 1/0 (or True/False) per token, [batch, pos], 1 at real tokens and 0 at padding
    """
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a tensor of shape [batch, pos], got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(tokens.shape):
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)}, but the tokens are {tuple(tokens.shape)}: give one "
            "1/0 (or True/False) per token, [batch, pos], 1 at real tokens and 0 at padding"
        )
    if mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError(
            "attention_mask must hold only 0 and 1 (or True and False): 1 at real tokens, 0 at padding"
        )


def padding_mask(model: Any, tokens: Tokens) -> Bool[Tensor, "batch pos"] | None:
    """An encoder's mask of real tokens, ``tokens != pad_token_id``; ``None`` when nothing is padding.

    Only for a bidirectional model with a tokenizer that has a pad token (BERT's ``[PAD]`` never occurs in
    tokenised text), so ``None`` on a decoder: a decoder's pad id is often a real token, and its padding is
    known from the texts' lengths instead (:func:`pad_texts`, :func:`to_batch`).

    >>> from types import SimpleNamespace
    >>> m = SimpleNamespace(cfg=SimpleNamespace(attention_dir="bidirectional"),
    ...                     tokenizer=SimpleNamespace(pad_token_id=0))
    >>> padding_mask(m, torch.tensor([[5, 6, 0]])).tolist()
    [[True, True, False]]
    """
    pad = getattr(getattr(model, "tokenizer", None), "pad_token_id", None)
    if pad is None or not is_bidirectional(model):
        return None
    mask = tokens != int(pad)
    return None if bool(mask.all()) else mask


def _encoder_tokens(model: Any, texts: list[str]) -> Tokens:
    """An encoder's ids: ``[CLS] text [SEP]``, right-padded with ``[PAD]`` (:func:`padding_mask` finds it)."""
    enc = model.tokenizer(texts, padding=True, truncation=False, return_tensors="pt")
    return enc["input_ids"].to(torch.long)


#: What every entry point accepts as input: text, texts, one sequence of token ids, or ``[pos]`` /
#: ``[batch, pos]`` integer tensors.
TokensOrText = str | Sequence[str] | Sequence[int] | Tensor


def to_tokens(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    min_pos: int = 1,
    what: str = "this analysis",
    encoders: bool = False,
) -> Tokens:
    """The one token validator: ids ``[batch, pos]`` from text (the model's tokenizer and BOS rule) or ids.

    Accepts a string, a list of strings, a list of ints (one sequence), or a 1-D or 2-D integer tensor.
    Raises ``TypeError`` for other types and for float or bool tensors (naming the dtype), and
    ``ValueError`` for empty input, blank text, an id outside ``0..d_vocab-1`` (naming the id), more
    than ``n_ctx`` positions, or fewer than ``min_pos`` (what ``what`` needs). An encoder (bidirectional
    attention) is refused with ``TypeError`` unless ``encoders=True`` (``what`` supports it); its texts become
    ``[CLS] text [SEP]``, right-padded with ``[PAD]``, which :func:`padding_mask` finds again.

    >>> from types import SimpleNamespace
    >>> m = SimpleNamespace(cfg=SimpleNamespace(d_vocab=10, n_ctx=4, device="cpu"))
    >>> to_tokens(m, [1, 2, 3]).tolist()
    [[1, 2, 3]]
    >>> to_tokens(m, torch.tensor([1, 12]))
    Traceback (most recent call last):
    ...
    ValueError: token id 12 is out of range: the model's vocabulary has 10 ids (0..9)
    """
    # Why this function is long: its signature and docstring document every argument (Args, Returns,
    # Raises); the body itself is 56 lines.
    if not encoders:
        check_decoder(model, what)
    cfg = model.cfg
    x = tokens_or_text
    texts: list[str] | None = None
    if isinstance(x, str):
        texts = [x]
    elif isinstance(x, Tensor):
        tokens = x
    elif isinstance(x, Sequence) and not isinstance(x, bytes | bytearray):
        items = list(x)
        if not items:
            raise ValueError("empty input: give a string, a list of strings, a list of token ids or a tensor")
        if all(isinstance(t, str) for t in items):
            texts = [str(t) for t in items]
        elif all(hasattr(t, "__index__") and not isinstance(t, bool | Tensor) for t in items):
            ids = [operator.index(t) for t in items]  # type: ignore[arg-type]
            bad = [t for t in ids if not 0 <= t < int(cfg.d_vocab)]
            if bad:
                raise ValueError(_id_error(bad[0], int(cfg.d_vocab)))
            tokens = torch.tensor([ids], dtype=torch.long)
        else:
            kinds = sorted({type(t).__name__ for t in items})
            raise TypeError(
                f"a list input must hold only strings (texts) or only ints (one sequence of token ids), got {kinds}"
            )
    else:
        raise TypeError(
            "tokens_or_text must be a string, a list of strings, a list of ints or an integer tensor, "
            f"got {type(x).__name__}"
        )
    if texts is not None:
        if any(not t.strip() for t in texts):
            raise ValueError("empty text: give at least one non-blank string")
        tokens = _encoder_tokens(model, texts) if is_bidirectional(model) else pad_texts(model, texts)[0]
    if tokens.dtype == torch.bool or tokens.dtype.is_floating_point or tokens.dtype.is_complex:
        raise TypeError(f"token ids must be an integer tensor, got dtype {tokens.dtype}")
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, pos] or [pos], got shape {tuple(tokens.shape)}")
    if tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"empty input: no tokens (shape {tuple(tokens.shape)})")
    d_vocab = int(cfg.d_vocab)
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= d_vocab:
        raise ValueError(_id_error(lo if lo < 0 else hi, d_vocab))
    n_ctx = int(cfg.n_ctx)
    if tokens.shape[1] > n_ctx:
        raise ValueError(f"sequence of {tokens.shape[1]} tokens is longer than the model's n_ctx={n_ctx}")
    if tokens.shape[1] < min_pos:
        raise ValueError(
            f"{what} needs at least {min_pos} positions per text, got {tokens.shape[1]} "
            f"(shape {tuple(tokens.shape)})"
        )
    return tokens.long().to(cfg.device)


def padding_side(model: Any) -> str:
    """Where a decoder's texts are padded: the tokenizer's ``padding_side`` (what TransformerLens'
    ``to_tokens`` uses too), ``"right"`` without a tokenizer; set ``model.tokenizer.padding_side = "left"``
    to pad on the left."""
    side = str(getattr(getattr(model, "tokenizer", None), "padding_side", None) or "right")
    if side not in ("left", "right"):
        raise ValueError(f"padding side {side!r}: expected 'left' or 'right'")
    return side


def _pad_id(model: Any) -> int:
    tok = getattr(model, "tokenizer", None)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        value = getattr(tok, name, None)
        if value is not None:
            return int(value)
    return 0


def pad_texts(
    model: Any, texts: Sequence[str], *, side: str | None = None
) -> tuple[Tokens, Bool[Tensor, "batch pos"] | None]:
    """A decoder's texts as one ``[batch, pos]`` batch and its mask of real tokens.

    Each text is tokenised alone (``model.to_tokens``, so the model's BOS rule holds), then padded with the
    tokenizer's pad token on ``side`` (default :func:`padding_side`). The mask comes from the lengths, never
    from the ids, because a pad id is often also a real token (SmolLM2's pad is its ``<|endoftext|>``).

    Returns:
        ``(tokens, mask)``; ``mask`` is ``None`` when every text has the same length (nothing is padding).
    """
    side = padding_side(model) if side is None else side
    rows = [model.to_tokens(t, truncate=False)[0].cpu() for t in texts]
    n = max(len(r) for r in rows)
    tokens = torch.full((len(rows), n), _pad_id(model), dtype=torch.long)
    mask = torch.zeros((len(rows), n), dtype=torch.bool)
    for b, r in enumerate(rows):
        cols = slice(0, len(r)) if side == "right" else slice(n - len(r), n)
        tokens[b, cols] = r
        mask[b, cols] = True
    return tokens, (None if bool(mask.all()) else mask)


def to_batch(
    model: Any,
    tokens_or_text: TokensOrText,
    *,
    attention_mask: Any = None,
    min_pos: int = 1,
    what: str = "this analysis",
    encoders: bool = False,
    align: bool = True,
) -> tuple[Tokens, Bool[Tensor, "batch pos"] | None]:
    """:func:`to_tokens` and the mask of real tokens that goes with them: what every entry point analyses.

    The mask is ``attention_mask`` when given (checked against the tokens); otherwise, for a list of texts of
    a decoder, the padding :func:`pad_texts` added (left or right, the model's :func:`padding_side`); for an
    encoder, its ``[PAD]`` ids (:func:`padding_mask`); an encoder's left-padded batch is right-aligned
    (:func:`right_align`, its absolute positions) unless ``align=False`` (the tokens of a cache, whose
    activations stand where they were). Token ids given as a tensor are taken as all real unless
    ``attention_mask`` says otherwise: a pad id is often a real token too.

    Returns:
        ``(tokens, mask)`` on the model's device; ``mask`` is a bool ``[batch, pos]`` tensor, or ``None`` when
        every position is real.

    Raises:
        As :func:`to_tokens`; and as :func:`check_attention_mask` for a mask of another shape or with values
        other than 0 and 1, or one that leaves a text with fewer than ``min_pos`` real tokens.

    >>> from types import SimpleNamespace
    >>> m = SimpleNamespace(cfg=SimpleNamespace(d_vocab=10, n_ctx=4, device="cpu"))
    >>> to_batch(m, torch.tensor([[1, 2, 3]]), attention_mask=torch.tensor([[0, 1, 1]]))[1].tolist()
    [[False, True, True]]
    """
    tokens = to_tokens(model, tokens_or_text, min_pos=min_pos, what=what, encoders=encoders)
    if attention_mask is not None:
        check_attention_mask(attention_mask, tokens)
        mask = attention_mask.to(device=tokens.device, dtype=torch.bool)
        short = (mask.sum(-1) < min_pos).nonzero().flatten().tolist()
        if short:
            raise ValueError(
                f"attention_mask leaves text(s) {short} with fewer than {min_pos} real token(s), which {what} "
                "needs: drop those texts or mark their tokens 1"
            )
        if is_bidirectional(model) and align:
            return _encoder_batch(tokens, None if bool(mask.all()) else mask)
        return tokens, (None if bool(mask.all()) else mask)
    if is_bidirectional(model):
        return (
            _encoder_batch(tokens, padding_mask(model, tokens))
            if align
            else (tokens, padding_mask(model, tokens))
        )
    x = tokens_or_text
    if isinstance(x, Sequence) and not isinstance(x, str | bytes) and len(x) > 1 and isinstance(x[0], str):
        mask = pad_texts(model, [str(t) for t in x])[1]
        return tokens, None if mask is None else mask.to(tokens.device)
    return tokens, None


def right_align(tokens: Tokens, mask: Bool[Tensor, "batch pos"]) -> tuple[Tokens, Bool[Tensor, "batch pos"]]:
    """Each text's real tokens moved to the start of its row (right padding), the pads' ids after them.

    Where positions are read from the row's first column (an encoder's absolute positions, the sink set
    ``S`` of the sink analyses), a left-padded text would sit at other positions than alone; right-aligned,
    it has its own, and causal attention keeps the pads after it out of every real position.

    Raises:
        ValueError: a text whose real tokens are not contiguous (padding inside a text).

    >>> t, m = right_align(torch.tensor([[9, 1, 2], [3, 4, 5]]), torch.tensor([[False, True, True], [True] * 3]))
    >>> t.tolist(), m.tolist()
    ([[1, 2, 9], [3, 4, 5]], [[True, True, False], [True, True, True]])
    """
    pos = torch.arange(tokens.shape[1], device=mask.device)
    first = torch.where(mask, pos, tokens.shape[1]).amin(-1)
    span = torch.where(mask, pos, -1).amax(-1) - first + 1
    gaps = (span != mask.sum(-1)).nonzero().flatten().tolist()
    if gaps:
        raise ValueError(
            f"attention_mask marks padding inside text(s) {gaps}: a text's real tokens must be contiguous "
            "(padding on the left or on the right only)"
        )
    if not bool(first.any()):
        return tokens, mask
    order = (pos[None, :] + first[:, None]) % tokens.shape[1]  # [batch, pos]: real tokens first
    return tokens.gather(1, order.to(tokens.device)), mask.gather(1, order)


def _encoder_batch(tokens: Tokens, mask: Tensor | None) -> tuple[Tokens, Tensor | None]:
    """An encoder's batch, right-aligned (:func:`right_align`): BERT's positions are absolute and
    TransformerLens does not shift them under a left-padding mask, so a left-padded text would be read at
    other positions than alone."""
    return (tokens, None) if mask is None else right_align(tokens, mask)


def text_positions(mask: Bool[Tensor, "batch pos"] | None, batch: int, pos: int) -> Tensor:
    """Each position's index inside its own text, ``[batch, pos]`` (``-1`` at padding): the position the
    same token has when its text is run alone. Without a mask, ``arange(pos)`` on every row.

    >>> text_positions(torch.tensor([[False, True, True], [True, True, False]]), 2, 3).tolist()
    [[-1, 0, 1], [0, 1, -1]]
    """
    if mask is None:
        return torch.arange(pos).expand(batch, pos).clone()
    m = mask.detach().cpu().bool()
    return torch.where(m, m.long().cumsum(-1) - 1, torch.full_like(m, -1, dtype=torch.long))


def check_text_position(position: Any, n_real: int, text: int, way_out: str = "") -> int:
    """A query position inside text ``text`` of ``n_real`` real tokens (negative from its end), as ``0..n_real-1``.

    Raises:
        IndexError: not an integer, or outside the text; the message names the text's valid range and, when
            given, ``way_out``.

    >>> check_text_position(-1, 4, 0)
    3
    """
    try:
        q = operator.index(position)
    except TypeError:
        raise IndexError(f"query {position!r} is not an integer position") from None
    if not -n_real <= q < n_real:
        raise IndexError(
            f"query {q} is outside text {text}, which has {n_real} real tokens (valid: {-n_real}..{n_real - 1}; "
            f"-1 is its last token){'; ' + way_out if way_out else ''}"
        )
    return q % n_real


#: What ``queries=`` accepts: positions in each text (negative from its end), a slice of them, or a boolean
#: ``[pos]`` / ``[batch, pos]`` mask over the padded batch.
Queries = int | Sequence[int] | slice | Tensor | None


def select_queries(
    queries: Queries, mask: Bool[Tensor, "batch pos"] | None, batch: int, pos: int
) -> Bool[Tensor, "batch pos"]:
    """The queries an analysis keeps, as a ``[batch, pos]`` boolean mask over the padded batch (CPU).

    Args:
        queries: ``None`` (every real position); an int or a sequence of ints, each a position *inside each
            text* (``-1`` is its last real token, the prediction position, wherever padding put it); a
            ``slice`` of those positions; or a boolean tensor, ``[pos]`` (the same for every text) or
            ``[batch, pos]``, over the padded batch.
        mask: the real tokens (``None``: all real).
        batch, pos: the batch's shape.

    Raises:
        TypeError: another type (a float, a bool, a string, a float tensor).
        IndexError: a position outside some text, naming that text's valid range.
        ValueError: a mask of another shape, one that selects padding, or one that selects nothing.

    >>> m = torch.tensor([[False, True, True], [True, True, True]])  # text 0 is left-padded
    >>> select_queries(-1, m, 2, 3).tolist()
    [[False, False, True], [False, False, True]]
    >>> select_queries(slice(0, 1), m, 2, 3).tolist()
    [[False, True, False], [True, False, False]]
    """
    real = torch.ones(batch, pos, dtype=torch.bool) if mask is None else mask.detach().cpu().bool()
    if queries is None:
        return real.clone()
    if isinstance(queries, Tensor):
        if queries.dtype != torch.bool:
            raise TypeError(
                f"a queries tensor must be a boolean mask ([pos] or [batch, pos]), got dtype {queries.dtype}; "
                "give positions as a list of ints"
            )
        sel = queries.detach().cpu()
        if sel.ndim == 1:
            sel = sel.expand(batch, -1)
        if tuple(sel.shape) != (batch, pos):
            raise ValueError(
                f"a queries mask must be [pos]={pos} or [batch, pos]=({batch}, {pos}), got {tuple(queries.shape)}"
            )
        if bool((sel & ~real).any()):
            raise ValueError(
                "the queries mask selects padding: mark only real tokens (the attention mask's 1s)"
            )
    else:
        lengths = real.sum(-1).tolist()
        if isinstance(queries, slice):
            picks = [list(range(n))[queries] for n in lengths]
        elif isinstance(queries, bool | str | bytes | float) or not (
            hasattr(queries, "__index__") or isinstance(queries, Sequence)
        ):
            raise TypeError(
                "queries must be an int, a sequence of ints, a slice or a boolean mask, "
                f"got {type(queries).__name__}"
            )
        else:
            items = [queries] if hasattr(queries, "__index__") else list(queries)  # type: ignore[arg-type]
            bad = [q for q in items if isinstance(q, bool) or not hasattr(q, "__index__")]
            if bad:
                raise TypeError(f"queries must be ints (positions in each text), got {bad[0]!r}")
            way_out = "give positions inside the shortest text, or a boolean mask per text"
            picks = [[check_text_position(q, n, b, way_out) for q in items] for b, n in enumerate(lengths)]
        sel = torch.zeros(batch, pos, dtype=torch.bool)
        for b, row in enumerate(picks):
            where = real[b].nonzero().flatten()
            if row:
                sel[b, where[torch.tensor(row, dtype=torch.long)]] = True
    if not bool(sel.any()):
        raise ValueError(f"queries={queries!r} selects no position: give at least one")
    return sel


def _id_error(token_id: int, d_vocab: int) -> str:
    if token_id < 0:
        return f"token id {token_id} is negative: ids must lie in 0..{d_vocab - 1}"
    return f"token id {token_id} is out of range: the model's vocabulary has {d_vocab} ids (0..{d_vocab - 1})"


def token_strings(model: Any, tokens: Tokens | None) -> list[list[str]] | None:
    """Each row of ``tokens`` as strings (``model.to_str_tokens``, or the tokenizer's own tokens where the
    model has no ``to_str_tokens``, as TransformerLens 3's ``HookedEncoder``); ``None`` without a tokenizer.

    >>> from types import SimpleNamespace
    >>> tok = SimpleNamespace(convert_ids_to_tokens=lambda ids: [f"<{i}>" for i in ids])
    >>> token_strings(SimpleNamespace(tokenizer=tok), torch.tensor([[1, 2]]))
    [['<1>', '<2>']]
    """
    tok = getattr(model, "tokenizer", None)
    if tokens is None or tok is None:
        return None
    to_str = getattr(model, "to_str_tokens", None)
    if callable(to_str):
        return [[str(t) for t in to_str(row)] for row in tokens]
    return [[str(t) for t in tok.convert_ids_to_tokens(row.tolist())] for row in tokens]
