"""Next-token loss under hooks: the one place where perplexity is computed.

Faithfulness (masking), sinks (ablation) and pruning all measure ``ΔPPL`` as
``PPL(with hooks) − PPL(clean)``, where PPL is ``exp`` of the mean next-token NLL over all predicted
tokens of all texts. Per-text mean NLLs are returned too, for bootstrap intervals.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mechgeom._progress import progress
from mechgeom.hooks import FwdHook
from mechgeom.typing import Float, Tensor, Tokens

__all__ = ["bootstrap_ci", "perplexity", "text_nll"]


def text_nll(
    model: Any,
    tokens: Tokens,
    fwd_hooks: Sequence[FwdHook] | Callable[[slice], Sequence[FwdHook]] = (),
    *,
    batch_size: int = 8,
    verbose: bool = False,
    desc: str = "nll",
) -> Float[Tensor, " batch"]:
    """Mean next-token NLL of each text (``[n_texts]``), with ``fwd_hooks`` attached.

    ``fwd_hooks`` may be a callable ``batch_slice -> hooks`` for hooks that depend on which texts are
    in the batch (per-text masks). Hooks are removed after every batch, also on error.
    """
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2:
        raise ValueError(f"need [n_texts >= 1, pos >= 2] tokens, got shape {tuple(tokens.shape)}")
    out = []
    starts = range(0, tokens.shape[0], batch_size)
    for start in progress(starts, desc=desc, enabled=verbose, total=len(starts)):
        sl = slice(start, min(start + batch_size, tokens.shape[0]))
        hooks = fwd_hooks(sl) if callable(fwd_hooks) else fwd_hooks
        batch = tokens[sl].to(model.cfg.device)
        with torch.no_grad(), model.hooks(fwd_hooks=list(hooks), reset_hooks_end=True):
            loss = model(batch, return_type="loss", loss_per_token=True)  # [batch, pos-1]
        out.append(loss.float().mean(dim=-1).cpu())
    return torch.cat(out)


def perplexity(model: Any, tokens: Tokens, fwd_hooks: Sequence[FwdHook] = (), **kwargs: Any) -> float:
    """``exp(mean NLL)`` over every predicted token of every text (equal-length windows)."""
    return float(torch.exp(text_nll(model, tokens, fwd_hooks, **kwargs).mean()))


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
