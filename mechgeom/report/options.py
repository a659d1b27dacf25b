"""The command line's argument types, shared by ``mechgeom run`` and ``mechgeom sweep``: each parses one
option's text or raises ``argparse.ArgumentTypeError`` with a message that names what is accepted.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["layer_list", "names", "positive", "rates", "seq_len"]


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def seq_len(text: str) -> int:
    value = positive(text)
    if value < 2:
        raise argparse.ArgumentTypeError("--seq-len must be at least 2 (one next-token prediction)")
    return value


def names(allowed: tuple[str, ...], what: str) -> Any:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(t.strip() for t in text.split(",") if t.strip())
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"{what}: {bad or text!r} not in {', '.join(allowed)}")
        return names

    return parse


def rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates: expected numbers like 0,0.1,0.5, got {text!r}") from None
    if not rates or any(not 0 <= r <= 1 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be in [0, 1], got {text!r}")
    return rates


def layer_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers: expected integers like 0,5,29, got {text!r}") from None
