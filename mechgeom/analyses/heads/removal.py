"""Batched single-head removal for :func:`mechgeom.analyses.heads.pruning.single_head_sweep`.

**Copies.** To evaluate ``K`` heads of one layer in one forward, the batch of ``n`` texts (their tokens,
or their clean residual stream at ``blocks.{l}.hook_resid_pre``) is repeated ``K`` times, copy-major:
rows ``k*n .. (k+1)*n - 1`` are copy ``k``. A single ``blocks.{l}.attn.hook_z`` hook (:func:`copies_hook`)
applies to copy ``k`` the very hook :func:`~mechgeom.hooks.interventions.head_ablation_hooks` builds for
head ``h_k`` alone (zeros, or the head's mean), and leaves the other heads of that copy untouched. Texts
never interact in a forward, so copy ``k`` gives what a forward with ``h_k`` removed alone gives (to float
rounding: the matrix products are blocked differently).

**Memory.** A forward holds at most ``COPIES_PER_BATCH * batch_size`` sequences (and at least one head's
texts), so its peak memory stays within about twice that of a :func:`~mechgeom.analyses.scoring.text_nll`
batch of ``batch_size`` texts; the heads of a layer are split evenly over as few forwards as that allows.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mechgeom.hooks import FwdHook, run_hooks
from mechgeom.typing import Float, Tensor, Tokens, Z

__all__ = [
    "COPIES_PER_BATCH",
    "batched_head_nll",
    "clean_resid",
    "copies_hook",
    "head_chunks",
    "text_batches",
]

#: A forward of the sweep holds at most ``COPIES_PER_BATCH * batch_size`` sequences.
COPIES_PER_BATCH = 2


def text_batches(n_texts: int, batch_size: int) -> list[slice]:
    """The batches of ``n_texts`` texts, ``batch_size`` at a time (the last one shorter).

    >>> text_batches(5, 2)
    [slice(0, 2, None), slice(2, 4, None), slice(4, 5, None)]
    """
    return [slice(s, min(s + batch_size, n_texts)) for s in range(0, n_texts, batch_size)]


def head_chunks(n_heads: int, n_texts: int, max_seqs: int) -> list[slice]:
    """Split ``n_heads`` heads into as few even runs as keep ``run length * n_texts <= max_seqs`` (at
    least one head per run).

    >>> head_chunks(9, 2, 16)
    [slice(0, 5, None), slice(5, 9, None)]
    >>> head_chunks(3, 8, 4)
    [slice(0, 1, None), slice(1, 2, None), slice(2, 3, None)]
    """
    per = max(1, max_seqs // max(1, n_texts))
    n_chunks = math.ceil(n_heads / per) if n_heads else 0
    bounds = [-(-i * n_heads // n_chunks) for i in range(n_chunks + 1)] if n_chunks else [0]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def copies_hook(fns: Sequence[Callable[..., Z]], n: int) -> Callable[[Z, Any], Z]:
    """``hook_z`` hook over ``len(fns)`` copies of ``n`` texts: copy ``k`` (rows ``k*n:(k+1)*n``) goes
    through ``fns[k]`` (a hook of :func:`~mechgeom.hooks.interventions.head_ablation_hooks`)."""

    def hook(z: Z, hook: Any) -> Z:
        # z: [len(fns) * n, pos, head_index, d_head], copy-major
        if z.shape[0] != len(fns) * n:
            raise ValueError(f"hook_z batch {z.shape[0]} is not {len(fns)} copies of {n} texts")
        return torch.cat([fn(z[k * n : (k + 1) * n], hook) for k, fn in enumerate(fns)])

    return hook


def clean_resid(
    cache: dict[str, Any], model: Any, tokens: Tokens, batch_size: int, layer: int
) -> tuple[Tokens, list[slice], list[Float[Tensor, "batch pos d_model"]]]:
    """The clean residual stream at ``blocks.{layer}.hook_resid_pre`` of each text batch, kept in
    ``cache`` and advanced block by block (restarted from the embeddings for an earlier layer). Returns
    the tokens on the model's device, the batches and their residual streams."""
    c = cache
    if c.get("layer", layer + 1) > layer:  # start (again) from the embeddings
        n = tokens.shape[0]
        c["toks"] = tokens.to(model.cfg.device)
        c["batches"] = text_batches(n, batch_size)
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


def _copies(x: Tensor, k: int) -> Tensor:
    return x.repeat(k, *([1] * (x.ndim - 1)))


def batched_head_nll(
    hooks: Sequence[FwdHook],
    inputs: Sequence[Tensor],
    toks: Tokens,
    batches: Sequence[slice],
    run: Callable[[Tensor, Tokens, list[FwdHook]], Float[Tensor, " batch"]],
    *,
    max_seqs: int,
) -> Float[Tensor, "head text"]:
    """``nll[k, t]``: text ``t``'s mean NLL with ``hooks[k]`` (one layer's single-head removal hooks, all
    on the same ``hook_z``) attached alone.

    ``inputs[b]`` is what the forward starts from for the texts ``batches[b]`` (tokens or a residual
    stream); ``run(x, tokens, fwd_hooks)`` is the forward, returning each row's mean NLL. The heads of a
    batch are run in copies (:func:`copies_hook`), at most ``max_seqs`` sequences per forward
    (:func:`head_chunks`)."""
    names = {name for name, _ in hooks}
    if len(names) > 1:
        raise ValueError(f"the hooks of one batched forward must share one hook point, got {sorted(names)}")
    nll = torch.full((len(hooks), toks.shape[0]), float("nan"))
    for x, sl in zip(inputs, batches, strict=True):
        n = sl.stop - sl.start
        for ks in head_chunks(len(hooks), n, max_seqs):
            group = hooks[ks]
            hook = (group[0][0], copies_hook([fn for _, fn in group], n))
            out = run(_copies(x, len(group)), _copies(toks[sl], len(group)), [hook])
            nll[ks, sl] = out.float().cpu().view(len(group), n)
    return nll
