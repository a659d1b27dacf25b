"""Next-token loss and multiple-choice scoring under hooks: the one place where both are computed.

Faithfulness (masking), sinks (ablation) and pruning all measure ``ΔPPL`` as
``PPL(with hooks) − PPL(clean)``, where PPL is ``exp`` of the mean next-token NLL over all predicted
tokens of all texts (:func:`token_nll`, :func:`text_nll`, :func:`perplexity`). Per-text mean NLLs are
returned too, for bootstrap intervals.

Multiple-choice items (:class:`~mechgeom.data.TaskItem`) are tokenised once (:func:`encode_choices`: the
prompt with the model's BOS default, each choice without BOS, long prompts cut from the left); a choice's
score is ``log p(choice | prompt) = sum_t log p(c_t | prompt, c_<t)`` (:func:`score_choices`), and an item
is answered correctly when its highest score, the first on ties, is the gold answer
(:func:`predicted_correct`, :func:`task_accuracy`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import torch

from mechgeom._progress import progress
from mechgeom.hooks import FwdHook, check_attention_mask, pass_mask, right_align, run_hooks
from mechgeom.models.adapter import adapter
from mechgeom.typing import Bool, Float, Tensor, Tokens

__all__ = [
    "EncodedItem",
    "bootstrap_ci",
    "encode_choices",
    "perplexity",
    "predicted_correct",
    "prediction_targets",
    "right_align",
    "score_choices",
    "target_logprob",
    "task_accuracy",
    "task_baselines",
    "text_nll",
    "token_nll",
]


# --------------------------------------------------------------------------- next-token loss


def prediction_targets(
    attention_mask: Bool[Tensor, "batch pos"] | Tensor | None, batch: int, pos: int
) -> Bool[Tensor, "batch pos_minus_1"]:
    """Which next-token predictions of a padded batch count: the prediction at ``t`` (of token ``t + 1``)
    where both tokens are real, so a pad is never a target and never predicts one (left or right padding).
    Without a mask, every prediction.

    >>> prediction_targets(torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]]), 2, 4).tolist()
    [[False, True, True], [True, False, False]]
    """
    if attention_mask is None:
        return torch.ones(batch, pos - 1, dtype=torch.bool)
    m = attention_mask.detach().cpu().bool()
    return m[:, :-1] & m[:, 1:]


def _padded(attention_mask: Tensor | None) -> Tensor | None:
    """The mask as bools, or ``None`` when it marks no padding (then the plain forward runs)."""
    if attention_mask is None:
        return None
    mask = attention_mask.bool()
    return None if bool(mask.all()) else mask


def token_nll(
    model: Any,
    inputs: Tokens | Float[Tensor, "batch pos d_model"],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
    **forward_kwargs: Any,
) -> Float[Tensor, "batch pos_minus_1"]:
    """Next-token NLL ``-log p(t_{i+1} | t_<=i)`` at every position, float32 on the CPU.

    One forward under ``torch.no_grad()`` with ``fwd_hooks`` attached (removed afterwards, also on error),
    TransformerLens' ``return_type="loss", loss_per_token=True``. ``forward_kwargs`` go to the model, e.g.
    ``start_at_layer=l, tokens=tokens`` to run from a residual stream ``inputs``.

    Args:
        attention_mask: ``[batch, pos]``, 1 at real tokens, 0 at padding (left or right). The forward then
            runs with it (padded keys are out of every query's attention, positions are those of each text
            alone) and tells mechgeom's readers (:func:`~mechgeom.hooks.pass_mask`); the NLL is 0 at every
            prediction that is not a target (:func:`prediction_targets`: a pad, or the prediction of one).
            ``None`` or a mask without padding runs the plain forward.

    Returns:
        ``[batch, pos - 1]``: the NLL of the prediction at ``t`` of token ``t + 1``.
    """
    mask = _padded(attention_mask)
    if mask is None:
        with torch.no_grad(), model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True):
            loss = model(inputs, return_type="loss", loss_per_token=True, **forward_kwargs)
        return loss.float().cpu()
    kwargs = adapter(model).forward_kwargs(return_type="logits", attention_mask=mask)
    tokens = forward_kwargs.get("tokens", inputs)
    with (
        torch.no_grad(),
        pass_mask(mask.to(tokens.device)),
        model.hooks(fwd_hooks=list(fwd_hooks), reset_hooks_end=True),
    ):
        logits = model(inputs, **kwargs, **forward_kwargs)  # [batch, pos, d_vocab]
    logp = logits[:, :-1].float().log_softmax(dim=-1)
    picked = logp.gather(-1, tokens[:, 1:, None].to(logp.device))[..., 0].cpu()  # [batch, pos-1]
    targets = prediction_targets(mask, *tokens.shape)
    return torch.where(targets, -picked, torch.zeros_like(picked))


def target_logprob(
    model: Any,
    tokens: Tokens,
    targets: Bool[Tensor, "batch pos_minus_1"],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
) -> Float[Tensor, " batch"]:
    """``sum`` of ``log p(token[t+1] | tokens[:t+1])`` over the predictions ``t`` where ``targets`` is true.

    The same numbers as ``-(token_nll(model, tokens, fwd_hooks) * targets).sum(-1)``. When the targets
    leave positions out (a choice after a long prompt) and the backend can
    (:attr:`~mechgeom.models.adapter.ModelAdapter.unembeds_positions`: a ``HookedTransformer``), only the
    positions some row needs are unembedded: the blocks run as usual (``stop_at_layer=n_layers``), then the
    final norm, the unembedding and the logit soft cap on those positions alone
    (:meth:`~mechgeom.models.adapter.ModelAdapter.logits`). With a 262k vocabulary (Gemma 3) the full
    unembedding is most of a forward pass. Other backends, or targets that cover every position, take the
    plain path.

    ``attention_mask`` (``[batch, pos]``, 1 at real tokens) runs the forward with the padding masked
    (:func:`token_nll`); a target at a pad or predicting one is dropped (:func:`prediction_targets`).
    """
    mask = _padded(attention_mask)
    if mask is not None:
        targets = targets & prediction_targets(mask, *tokens.shape).to(targets.device)
    cols = targets.any(0).nonzero().squeeze(-1)  # [n_cols] prediction positions any row scores
    backend = adapter(model)
    if not backend.unembeds_positions or cols.numel() == targets.shape[1]:
        loss = token_nll(model, tokens, fwd_hooks, attention_mask=mask)  # [batch, pos-1], float32, CPU
        return -(loss * targets.to(loss.device)).sum(-1)
    resid = run_hooks(
        model, tokens, fwd_hooks, stop_at_layer=model.cfg.n_layers, attention_mask=mask
    )  # [batch, pos, d_model], before ln_final
    with torch.no_grad():
        logits = backend.logits(resid[:, cols.to(resid.device)])  # [batch, n_cols, d_vocab]
    logp = logits.float().log_softmax(dim=-1)
    nxt = tokens[:, cols + 1].to(logp.device)  # [batch, n_cols] the predicted tokens
    picked = logp.gather(-1, nxt[..., None])[..., 0].cpu()  # [batch, n_cols]
    return (picked * targets[:, cols]).sum(-1)


def text_nll(
    model: Any,
    tokens: Tokens,
    fwd_hooks: Sequence[FwdHook] | Callable[[slice], Sequence[FwdHook]] = (),
    *,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
    batch_size: int = 8,
    verbose: bool = False,
    desc: str = "nll",
) -> Float[Tensor, " batch"]:
    """Mean next-token NLL of each text (``[n_texts]``) over its predicted tokens.

    ``fwd_hooks`` may be a callable ``batch_slice -> hooks`` for hooks that depend on which texts are
    in the batch (per-text masks). Hooks are removed after every batch, also on error.

    ``attention_mask`` (``[n_texts, pos]``, 1 at real tokens, left or right padding) runs each batch with
    its rows of the mask; a text's mean is then over its own real predictions only
    (:func:`prediction_targets`), the number it has when run alone. Every text needs two real tokens.
    """
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2:
        raise ValueError(f"need [n_texts >= 1, pos >= 2] tokens, got shape {tuple(tokens.shape)}")
    mask = _padded(attention_mask)
    if mask is not None:
        check_attention_mask(mask, tokens)
        short = (prediction_targets(mask, *tokens.shape).sum(-1) == 0).nonzero().flatten().tolist()
        if short:
            raise ValueError(
                f"text(s) {short} have fewer than 2 real tokens, so nothing to predict: drop them or mark "
                "their tokens 1 in attention_mask"
            )
    out = []
    starts = range(0, tokens.shape[0], batch_size)
    for start in progress(starts, desc=desc, enabled=verbose, total=len(starts)):
        sl = slice(start, min(start + batch_size, tokens.shape[0]))
        hooks = fwd_hooks(sl) if callable(fwd_hooks) else fwd_hooks
        sub = None if mask is None else mask[sl].to(model.cfg.device)
        loss = token_nll(model, tokens[sl].to(model.cfg.device), hooks, attention_mask=sub)
        n = prediction_targets(sub, int(loss.shape[0]), int(tokens.shape[1])).sum(-1)
        out.append(loss.sum(dim=-1) / n)
    return torch.cat(out)


def perplexity(
    model: Any,
    tokens: Tokens,
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    attention_mask: Bool[Tensor, "batch pos"] | None = None,
    **kwargs: Any,
) -> float:
    """``exp`` of the mean over texts of each text's mean next-token NLL (:func:`text_nll`); for
    equal-length windows, ``exp`` of the mean over every predicted token. ``attention_mask`` as in
    :func:`text_nll`: each text's mean is over its real predictions, as when it runs alone."""
    return float(
        torch.exp(text_nll(model, tokens, fwd_hooks, attention_mask=attention_mask, **kwargs).mean())
    )


def bootstrap_ci(
    per_text: np.ndarray | Tensor,
    stat: Callable[[np.ndarray], float] = np.mean,
    *,
    n_boot: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> tuple[float, float]:
    """Percentile bootstrap interval of ``stat`` over texts (resampling rows with replacement).

    ``per_text`` may be ``[n_texts]`` or ``[n_texts, k]`` (then ``stat`` receives the resampled rows).
    """
    x = np.asarray(per_text)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_boot, len(x)))
    vals = np.array([stat(x[i]) for i in idx])
    lo, hi = np.quantile(vals, [(1 - level) / 2, 1 - (1 - level) / 2])
    return float(lo), float(hi)


# --------------------------------------------------------------------------- multiple choice


class EncodedItem(NamedTuple):
    """Token ids of one multiple-choice item: the prompt (model's BOS default) and each choice (no BOS)."""

    prompt: list[int]
    choices: list[list[int]]


def _encode(model: Any, text: str, *, prepend_bos: bool) -> list[int]:
    """Token ids of ``text`` with the model's tokenizer (one place, so tests can swap it)."""
    return [int(t) for t in model.to_tokens(text, prepend_bos=prepend_bos, truncate=False)[0].tolist()]


def encode_choices(model: Any, items: Sequence[Any], max_len: int | None = None) -> list[EncodedItem]:
    """Tokenise multiple-choice items (``.prompt``, ``.choices``, ``.answer``, e.g. :class:`~mechgeom.data.TaskItem`).

    The prompt gets the model's BOS default (``model.cfg.default_prepend_bos``), each choice none; a prompt
    longer than ``max_len - (longest choice)`` (``max_len`` defaults to ``n_ctx``) loses tokens from the
    left, so every ``prompt + choice`` fits in ``max_len``. Raises ``ValueError`` for an answer out of
    range (or no choices), a choice with no tokens, a choice not shorter than ``max_len`` and an empty
    prompt.
    """
    limit = int(model.cfg.n_ctx) if max_len is None else int(max_len)
    bos = bool(getattr(model.cfg, "default_prepend_bos", False))
    out = []
    for i, item in enumerate(items):
        if not item.choices or not 0 <= int(item.answer) < len(item.choices):
            raise ValueError(f"item {i} has answer {item.answer} but {len(item.choices)} choices")
        choices = []
        for c, choice in enumerate(item.choices):
            ids = _encode(model, choice, prepend_bos=False)
            if not ids:
                raise ValueError(f"item {i} choice {c} ({choice!r}) has no tokens")
            if len(ids) >= limit:
                raise ValueError(
                    f"item {i} choice {c} is {len(ids)} tokens, not shorter than max_len={limit}"
                )
            choices.append(ids)
        prompt = _encode(model, item.prompt, prepend_bos=bos)
        prompt = prompt[-(limit - max(len(ids) for ids in choices)) :]  # left-truncate long prompts
        if not prompt:
            raise ValueError(f"item {i} has an empty prompt; the first choice token needs a context")
        out.append(EncodedItem(prompt, choices))
    return out


def _as_encoded(model: Any, items: Sequence[Any], max_len: int | None) -> list[EncodedItem]:
    if not items:
        raise ValueError("no items to score")
    if not isinstance(items[0], tuple):
        return encode_choices(model, items, max_len)
    enc = [EncodedItem([int(t) for t in p], [[int(t) for t in ch] for ch in chs]) for p, chs in items]
    if any(not p or not ch for p, chs in enc for ch in chs):
        raise ValueError("every prompt and every choice needs at least one token")
    return enc


def score_choices(
    model: Any,
    items: Sequence[Any],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    batch_size: int = 8,
    max_len: int | None = None,
) -> Float[Tensor, "item choice"]:
    """Summed log-likelihood of each choice's tokens given the prompt, ``log p(choice | prompt)`` (float64).

    ``items`` are task items (tokenised by :func:`encode_choices` with ``max_len``) or already tokenised
    :class:`EncodedItem` / ``(prompt_ids, [choice_ids, ...])``. Where every choice of an item is one token,
    one forward of the prompt scores all of them (from the last position); otherwise each
    ``prompt + choice`` is one sequence. Sequences are sorted by length and right-padded; with causal
    attention the padding never reaches a scored position. Every item must have the same number of choices.
    """
    enc = _as_encoded(model, items, max_len)
    n_choices = {len(item.choices) for item in enc}
    if len(n_choices) != 1:
        raise ValueError(f"items have different numbers of choices: {sorted(n_choices)}")
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


def predicted_correct(
    scores: Float[Tensor, "item choice"] | np.ndarray | Sequence[Sequence[float]], answers: Sequence[int]
) -> np.ndarray:
    """``1.0`` per item where the highest score (the first on ties) is the answer, else ``0.0``.

    ``scores`` is ``[item, choice]`` or one list per item (items may have different numbers of choices).

    >>> predicted_correct([[0.1, 0.5], [0.3, 0.3], [1.0, 0.0, 2.0]], [1, 1, 2]).tolist()
    [1.0, 0.0, 1.0]
    """
    if isinstance(scores, Tensor):
        rows: list[np.ndarray] = list(scores.detach().cpu().double().numpy())
    else:
        rows = [np.asarray(s, dtype=np.float64) for s in scores]
    gold = [int(a) for a in answers]
    if len(rows) != len(gold):
        raise ValueError(f"{len(rows)} rows of scores but {len(gold)} answers")
    for i, (s, a) in enumerate(zip(rows, gold, strict=True)):
        if s.ndim != 1 or not 0 <= a < len(s):
            raise ValueError(f"item {i} has answer {a} but {s.size} scores")
    return np.array([float(int(np.argmax(s)) == a) for s, a in zip(rows, gold, strict=True)])


def task_accuracy(
    model: Any,
    items: Sequence[Any],
    fwd_hooks: Sequence[FwdHook] = (),
    *,
    batch_size: int = 8,
    max_len: int | None = None,
    encoded: Sequence[EncodedItem] | Sequence[tuple[list[int], list[list[int]]]] | None = None,
) -> float:
    """Share of items whose highest-scoring choice (:func:`score_choices`, :func:`predicted_correct`) is
    the gold answer; ``encoded`` (from :func:`encode_choices`) skips the tokenisation."""
    scores = score_choices(
        model, encoded if encoded is not None else items, fwd_hooks, batch_size=batch_size, max_len=max_len
    )
    return float(predicted_correct(scores, [item.answer for item in items]).mean())


def task_baselines(items: Sequence[Any]) -> pd.DataFrame:
    """Per task (and ``"all"`` when the items mix tasks): the accuracy of guessing, ``chance`` (the mean
    over items of ``1 / n_choices``), and of always giving the most common answer position,
    ``majority`` (its share among the items), with ``n_items``.

    >>> from mechgeom.data import TaskItem
    >>> its = [TaskItem("t", "q", (" no", " yes"), a) for a in (1, 1, 0)]
    >>> task_baselines(its).to_dict("records")
    [{'task': 't', 'chance': 0.5, 'majority': 0.6666666666666666, 'n_items': 3}]
    """
    tasks = [str(getattr(it, "task", "items")) for it in items]
    groups = list(dict.fromkeys(tasks))
    rows = []
    for g in [*groups, *(["all"] if len(groups) > 1 else [])]:
        sel = [it for it, t in zip(items, tasks, strict=True) if g in ("all", t)]
        answers = np.array([int(it.answer) for it in sel])
        rows.append(
            {
                "task": g,
                "chance": float(np.mean([1.0 / len(it.choices) for it in sel])),
                "majority": float(np.bincount(answers).max() / len(answers)),
                "n_items": len(sel),
            }
        )
    return pd.DataFrame(rows)
