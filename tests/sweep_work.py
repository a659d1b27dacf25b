"""Work functions for the executor tests: module-level and picklable, importable by Ray workers
(``tests.sweep_work`` with the repository root on ``PYTHONPATH``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from mechgeom.analyses.scoring import text_nll
from mechgeom.sweep import Item


@dataclass
class TextNLL:
    """Item ``(b,)`` with ``data`` = token rows: the mean next-token NLL of each row on the model (real
    model work), keyed by row index; ``delay`` seconds of sleep per item leave time to kill a worker."""

    tokens: torch.Tensor
    delay: float = 0.0

    def __call__(self, model: Any, item: Item) -> pd.DataFrame:
        if self.delay:
            time.sleep(self.delay)
        rows = list(item.data)
        nll = text_nll(model, self.tokens[rows])
        return pd.DataFrame({"row": rows, "nll": nll.double().numpy(), "batch": item.batch})


def items(n_rows: int, per_item: int = 1, per_batch: int = 2) -> list[Item]:
    """Items of ``per_item`` rows each; ``per_batch`` consecutive items share a batch."""
    out = []
    for k, s in enumerate(range(0, n_rows, per_item)):
        rows = tuple(range(s, min(s + per_item, n_rows)))
        out.append(Item(key=(k,), rows=tuple((r,) for r in rows), batch=k // per_batch, data=rows))
    return out


def encoder_input() -> tuple[torch.Tensor, torch.Tensor]:
    """Five texts of ids for a tiny encoder, two of them padded: ``(tokens, mask)``, mask 1 = real token."""
    mask = torch.ones(5, 8, dtype=torch.long)
    mask[1, 5:], mask[3, 6:] = 0, 0
    tokens = torch.randint(0, 50, (5, 8), generator=torch.Generator().manual_seed(2))
    return tokens, mask
